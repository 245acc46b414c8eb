"""The user-facing engine: ``LLM(model).generate(prompts, max_tokens, temperature, ...)``.

>>> llm = LLM("tiny")                        # a preset with random weights, or a Hugging Face folder
>>> out = llm.generate(["hello"], max_tokens=16, temperature=0.8, top_p=0.9, seed=1)
>>> out[0].text, out[0].token_ids, out[0].finish_reason
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch

from pagedattn.engine.block_manager import BlockManager
from pagedattn.engine.config import ATTENTION_BACKENDS, EngineConfig, MLAModelConfig, ModelConfig, resolve_model
from pagedattn.engine.runner import ModelRunner
from pagedattn.engine.scheduler import Scheduler
from pagedattn.engine.sequence import SamplingParams, Sequence, Status
from pagedattn.engine.tokenizer import load_tokenizer
from pagedattn.engine.weights import load_model

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def default_device() -> str:
    """CUDA when present and the interpreter is not forced, else the CPU."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return "cuda"
    return "cpu"


def parse_dtype(dtype, device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def ensure_interpreter(device, dtype: torch.dtype, uses_triton: bool) -> None:
    """On the CPU the pagedattn kernels (``uses_triton``) run in Triton's interpreter: set
    TRITON_INTERPRET=1 if triton is not imported yet (else raise), and refuse bf16 (the
    interpreter's bf16 tl.dot is broken)."""
    if torch.device(device).type != "cpu" or not uses_triton:
        return
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        if "triton.language" in sys.modules:
            raise RuntimeError("triton was imported without TRITON_INTERPRET=1 (transformers imports it): on the "
                               "CPU set TRITON_INTERPRET=1 before importing triton, transformers or pagedattn.api")
        os.environ["TRITON_INTERPRET"] = "1"
    if dtype == torch.bfloat16:
        raise ValueError("dtype bfloat16 does not run on the Triton interpreter (CPU); use float32 or float16")


@dataclass
class RequestOutput:
    prompt_token_ids: list
    token_ids: list
    text: str
    finish_reason: str
    ttft_s: float  # arrival to first token
    latency_s: float  # arrival to last token


class Engine:
    """Scheduler + block manager + model runner over an already built model."""

    def __init__(self, model, mcfg: ModelConfig, ecfg: EngineConfig, *, eos_token_ids=None, tokenizer=None):
        self.mcfg, self.ecfg = mcfg, ecfg
        self.tokenizer = tokenizer
        self.blocks = BlockManager(ecfg.num_blocks, ecfg.block_size)
        eos = mcfg.eos_token_ids if eos_token_ids is None else eos_token_ids
        self.scheduler = Scheduler(ecfg, self.blocks, eos, stop_checker=self._stop_string)
        with torch.inference_mode():
            self.runner = ModelRunner(model, mcfg, ecfg)
        self.step_records: list | None = None  # a list: record every step's timing
        self.time_gpu = True  # with step_records: also CUDA events around the forward (one more sync)

    def _stop_string(self, seq: Sequence) -> bool:
        """Whether the output text holds one of the request's stop strings; sets ``seq.stop_index``
        to where the text ends (the first match)."""
        text = self.tokenizer.decode(seq.output_ids)
        hits = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
        if not hits:
            return False
        seq.stop_index = min(hits)
        return True

    def output_text(self, seq: Sequence) -> str:
        """The output's text, cut before the stop string that ended it."""
        text = self.tokenizer.decode(seq.output_ids)
        return text if seq.stop_index is None else text[:seq.stop_index]

    def _new_sequence(self, token_ids, params: SamplingParams) -> Sequence:
        seq = Sequence(token_ids, params)
        if any(not 0 <= t < self.mcfg.vocab_size for t in seq.token_ids):
            raise ValueError(f"prompt token ids must lie in [0, {self.mcfg.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= to Engine (LLM does)")
        if any(not 0 <= t < self.mcfg.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must lie in [0, {self.mcfg.vocab_size})")
        self.scheduler.check(seq)
        return seq

    def add(self, token_ids, params: SamplingParams, *, arrival_time: float | None = None) -> Sequence:
        """Queue one request (ValueError for bad input); :meth:`step` runs it. ``arrival_time``
        (``time.perf_counter()`` clock; default now) is what its TTFT counts from."""
        seq = self._new_sequence(token_ids, params)
        seq.arrival_time = arrival_time
        self.scheduler.add(seq)
        return seq

    @torch.inference_mode()
    def step(self) -> tuple[list[Sequence], int]:
        """Schedule and run one step; returns (finished sequences, tokens sampled).

        With ``step_records`` on, the step is timed from before scheduling to after sampling
        (``step_ms``: CUDA events on a GPU, else wall time; ``wall_ms``: wall time) and
        ``host_ms`` is the wall time the host did not spend waiting for the device (from the
        step's start until its forward was queued, plus the bookkeeping after the sampled tokens
        reached the host).
        """
        timed = self.step_records is not None
        cuda = self.runner.device.type == "cuda"
        self.runner.time_forward = timed and self.time_gpu
        if timed:
            t0 = time.perf_counter()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            raise RuntimeError("the scheduler could not schedule any sequence (KV cache too small?)")
        sampled = self.runner.execute(batch)
        finished = self.scheduler.postprocess(batch, sampled)
        if timed:
            t1 = time.perf_counter()
            wall_ms = (t1 - t0) * 1e3
            wait_ms = (self.runner.last_sampled - self.runner.last_enqueued) * 1e3
            if cuda:
                end.record()
                end.synchronize()
                step_ms = start.elapsed_time(end)
            else:
                step_ms = wall_ms
            self.step_records.append(dict(
                decode=batch.is_decode, num_seqs=len(batch.seqs), num_tokens=batch.num_tokens, step_ms=step_ms,
                forward_ms=self.runner.last_forward_ms if cuda else None, graph=self.runner.last_used_graph,
                wall_ms=wall_ms, host_ms=wall_ms - wait_ms, sampled=len(sampled),
            ))
        return finished, len(sampled)

    def run(self, seqs: list[Sequence], progress=None) -> None:
        """Step until every sequence of ``seqs`` is finished; ``progress(n)`` gets sampled counts."""
        while any(s.status is not Status.FINISHED for s in seqs):
            _, n = self.step()
            if progress is not None and n:
                progress(n)

    def generate(self, prompts_token_ids, params: list[SamplingParams], progress=None) -> list[Sequence]:
        seqs = [self._new_sequence(ids, p) for ids, p in zip(prompts_token_ids, params)]  # all checked first
        start = time.perf_counter()
        for seq in seqs:
            seq.arrival_time = start
            self.scheduler.add(seq)
        self.run(seqs, progress)
        return seqs

    @torch.inference_mode()
    def prompt_logits(self, token_ids) -> torch.Tensor:
        """Logits ``[len(token_ids), vocab]`` fp32 of every prompt position (chunked like any
        prompt); the engine must be idle."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("prompt_logits needs an idle engine")
        seq = Sequence(token_ids, SamplingParams(max_tokens=1))
        self.scheduler.add(seq)
        rows = []
        while seq.status is not Status.FINISHED:
            batch = self.scheduler.schedule()
            logits = self.runner.forward(batch, all_tokens=True)
            offset, sampled = 0, []
            for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new)):
                if s is seq:
                    rows.append(logits[offset:offset + n])
                if batch.samples(i):
                    sampled.append(int(logits[offset + n - 1].argmax()))
                offset += n
            self.scheduler.postprocess(batch, sampled)
        return torch.cat(rows)


class LLM:
    """Load a model (a preset name with random weights, or a Hugging Face folder) and generate.

    Parameters
    ----------
    model : str
        A preset (``"tiny"``, ``"llama-3.1-8b"``; the MLA decoder ``"deepseek-v2-lite"``, ``"tiny-mla"``)
        or a folder with config.json and *.safetensors.
    attention : ``"pagedattn"`` (automatic path), ``"pagedattn-2d"`` (unified path), ``"sdpa"`` or
        ``"flashinfer"`` (needs the package and a GPU). An MLA model: ``"pagedattn"`` (the ``mla``
        backend) or ``"sdpa"`` (SDPA over decompressed K/V).
    device, dtype : default CUDA/bfloat16 when a GPU is present, else CPU/float32 (interpreter).
    max_model_len : longest prompt + output (default min(max_position_embeddings, 4096)).
    max_num_seqs, max_num_batched_tokens, block_size, num_blocks, enforce_eager,
    cuda_graph_sizes, seed : see :class:`pagedattn.engine.config.EngineConfig`.
    """

    def __init__(self, model: str = "tiny", *, attention: str = "pagedattn", device=None, dtype=None,
                 max_model_len: int | None = None, max_num_seqs: int = 16, max_num_batched_tokens: int = 2048,
                 block_size: int = 16, num_blocks: int | None = None, enforce_eager: bool = False,
                 cuda_graph_sizes=None, seed: int = 0):
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}")
        device = device or default_device()
        dtype = parse_dtype(dtype, device)
        self.model_config, folder = resolve_model(model)
        # an MLA model's latent cache is written by a Triton kernel whatever attends it
        ensure_interpreter(device, dtype, attention != "sdpa" or isinstance(self.model_config, MLAModelConfig))
        max_model_len = max_model_len or min(self.model_config.max_position_embeddings, 4096)
        self.config = EngineConfig(
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size, num_blocks=num_blocks, attention=attention, device=str(device),
            dtype=str(dtype).removeprefix("torch."), enforce_eager=enforce_eager,
            cuda_graph_sizes=list(cuda_graph_sizes or []), seed=seed,
        )
        self.random_weights = folder is None  # a preset: random weights, so the text is gibberish
        self.model = load_model(self.model_config, folder, device=device, dtype=dtype, seed=seed)
        self.tokenizer = load_tokenizer(folder, self.model_config.vocab_size)
        eos = set(self.model_config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.engine = Engine(self.model, self.model_config, self.config, eos_token_ids=eos, tokenizer=self.tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return getattr(self.tokenizer, "chat_template", None) is not None

    def encode(self, prompt, *, chat: bool = False) -> list[int]:
        """Token ids of a prompt: a string (``chat``: a user message in the folder's chat template,
        with the generation prompt), a list of chat messages (``{"role", "content"}`` dicts; the
        template), or token ids as they are."""
        if isinstance(prompt, str) and not chat:
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
            if not self.has_chat_template:
                raise ValueError("chat needs a tokenizer with a chat template (the model folder has none)")
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            return self.tokenizer.apply_chat_template(messages)
        return [int(t) for t in prompt]

    def generate(self, prompts, max_tokens: int = 16, temperature: float = 0.0, *, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0, stop=(),
                 stop_token_ids=(), seed: int | None = None, ignore_eos: bool = False, sampling_params=None,
                 chat: bool = False, progress: bool = False) -> list[RequestOutput]:
        """Generate for each prompt (a string, a list of chat messages or a list of token ids);
        outputs in prompt order.

        The keyword arguments are :class:`SamplingParams` fields for every prompt; or
        ``sampling_params``: one :class:`SamplingParams`, or one per prompt. ``chat``: string
        prompts become user messages in the folder's chat template.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams(
                max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                repetition_penalty=repetition_penalty, stop=stop, stop_token_ids=stop_token_ids, seed=seed,
                ignore_eos=ignore_eos)
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        ids = [self.encode(p, chat=chat) for p in prompts]
        bar = _progress_bar(sum(p.max_tokens for p in params)) if progress else None
        try:
            seqs = self.engine.generate(ids, params, progress=bar.update if bar else None)
        finally:
            if bar is not None:
                bar.close()
        return [RequestOutput(prompt_token_ids=s.token_ids[:s.num_prompt_tokens], token_ids=s.output_ids,
                              text=self.engine.output_text(s), finish_reason=s.finish_reason,
                              ttft_s=s.first_token_time - s.arrival_time, latency_s=s.finish_time - s.arrival_time)
                for s in seqs]

    def prompt_logits(self, prompt) -> torch.Tensor:
        """Logits ``[prompt_len, vocab]`` fp32 at every prompt position."""
        return self.engine.prompt_logits(self.encode(prompt))


class _SimpleBar:
    def __init__(self, total: int):
        self.total, self.done = total, 0

    def update(self, n: int) -> None:
        self.done += n
        print(f"\r{self.done}/{self.total} tokens", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(file=sys.stderr)


def _progress_bar(total: int):
    """tqdm when installed, else a one-line counter on stderr."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _SimpleBar(total)
    return tqdm(total=total, unit="tok", file=sys.stderr, leave=False)
