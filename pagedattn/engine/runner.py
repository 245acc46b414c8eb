"""The model runner: per-step inputs and metadata, one attention plan per step, the forward
pass, CUDA-graph decode, sampling.

Decode batches (one new token per sequence) on CUDA replay a graph captured for the smallest
batch-size bucket that holds them (``EngineConfig.cuda_graph_sizes``). The graphs read static
input buffers; each step writes its inputs into pinned host staging buffers, pads the rest of
the bucket (no query tokens, no cache writes), copies them to the static buffers asynchronously
(:class:`GraphInputs`), re-plans the persistent path in place with ``plan.update()`` and
replays (an MLA model's graphs have nothing to re-plan). Everything else (prefill, extend, mixed
batches, the CPU) runs eagerly with a fresh plan per step.
"""

from __future__ import annotations

import time

import torch

from pagedattn.engine.attention import StepMetadata, make_backend
from pagedattn.engine.config import EngineConfig, ModelConfig
from pagedattn.engine.sampler import Sampler
from pagedattn.engine.scheduler import ScheduledBatch


class GraphInputs:
    """The decode graphs' static input buffers on the device, and their host staging.

    Device buffers, read by every captured graph (``static``: views of these, by name):
    ``ints`` ``[5, width]`` int64, rows input_ids, positions, slot_mapping, cache_rows and the
    rows of the bucket's logits to sample (``select``: read after the replay, not by the graph);
    ``lens`` ``[2, width]`` int32, rows seq_lens and query_start_loc; ``block_table``
    ``[top, pages]`` int32. ``width`` holds ``top + 1`` entries, rounded up to 16 bytes.

    A step writes its host inputs into the staging buffers (pinned when the device is CUDA) and
    enqueues three ``copy_(non_blocking=True)`` on the current stream: all of ``ints``, all of
    ``lens`` (a few KiB; entries past the bucket are unread by its graph and get what they last
    held), and the step's ``[bucket, width of its table]`` block (staged contiguously, so the
    pinned memory is what the copy reads; the strided device destination costs one small
    device-side copy, as it did before). The logits are gathered with the staged ``select``.

    Safety of reusing the buffers:

    * device side: the copies are enqueued on the stream the previous step replayed its graph
      (and gathered its logits) on, after those; the graph reads its inputs before they change;
    * host side: a non_blocking copy from pinned memory reads it when the copy executes, which
      may be after ``write`` returns. So ``write`` records an event after its copies and the next
      ``write`` waits on it before touching the staging buffers. The engine synchronizes every
      step anyway (the sampler reads tokens back), so the wait finds the event done and costs
      nothing; it guards steps that do not (``forward`` without sampling).

    On the CPU (emulated graphs) the same code runs with ordinary memory and no event.
    """

    INT64_ROWS = ("input_ids", "positions", "slot_mapping", "cache_rows", "select")
    INT32_ROWS = ("seq_lens", "query_start_loc")

    def __init__(self, top: int, pages: int, padding_row: int, device):
        device = torch.device(device)
        width = -(-(top + 1) // 4) * 4
        self.ints = torch.zeros(len(self.INT64_ROWS), width, dtype=torch.int64, device=device)
        self.lens = torch.zeros(len(self.INT32_ROWS), width, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(top, pages, dtype=torch.int32, device=device)
        self.static = {name: self.ints[i, :top] for i, name in enumerate(self.INT64_ROWS)}
        self.static.update({name: self.lens[i, :top] for i, name in enumerate(self.INT32_ROWS)})
        self.static["query_start_loc"] = self.lens[self.INT32_ROWS.index("query_start_loc"), :top + 1]
        self.static["block_table"] = self.block_table
        # what the graphs are captured with: every row padding
        self.static["slot_mapping"].fill_(-1)
        self.static["cache_rows"].fill_(padding_row)
        self.static["seq_lens"].fill_(1)
        self.static["query_start_loc"].copy_(torch.arange(top + 1, dtype=torch.int32))
        pin = device.type == "cuda" and torch.cuda.is_available()
        self.host_ints = torch.empty(self.ints.shape, dtype=torch.int64, pin_memory=pin)
        self.host_lens = torch.empty(self.lens.shape, dtype=torch.int32, pin_memory=pin)
        self.host_ints.copy_(self.ints)
        self.host_lens.copy_(self.lens)
        self.host_table = torch.zeros(top * pages, dtype=torch.int32, pin_memory=pin)
        self.device = device
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    @property
    def select(self) -> torch.Tensor:
        return self.static["select"]

    def write(self, host, select: list) -> None:
        """Stage one step's padded decode inputs (``_decode_inputs``) and the rows to sample, and
        enqueue their copies to the device buffers (class docstring)."""
        ids, pos, slots, rows, qsl, lens, table = host
        bucket, width = table.shape
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copies have read the staging buffers
        self.host_ints[:4, :bucket].copy_(torch.tensor([ids, pos, slots, rows], dtype=torch.int64))
        self.host_ints[4, :len(select)].copy_(torch.tensor(select, dtype=torch.int64))
        self.host_lens[0, :bucket].copy_(torch.tensor(lens, dtype=torch.int32))
        self.host_lens[1, :bucket + 1].copy_(torch.tensor(qsl, dtype=torch.int32))
        staged_table = self.host_table[:bucket * width].view(bucket, width)
        staged_table.copy_(table)
        self.ints.copy_(self.host_ints, non_blocking=True)
        self.lens.copy_(self.host_lens, non_blocking=True)
        self.block_table[:bucket, :width].copy_(staged_table, non_blocking=True)
        if self.copied is not None:
            self.copied.record(torch.cuda.current_stream(self.device))  # the stream the copies went to


class ModelRunner:
    def __init__(self, model, mcfg: ModelConfig, ecfg: EngineConfig):
        self.model, self.mcfg, self.ecfg = model, mcfg, ecfg
        self.device, self.dtype = model.device, model.dtype
        model.build_rotary(ecfg.max_model_len)
        self.attn = make_backend(mcfg, ecfg, device=self.device, dtype=self.dtype)
        self.sampler = Sampler(self.device, ecfg.seed)
        self.pages_per_seq = -(-ecfg.max_model_len // ecfg.block_size)
        self.padding_row = ecfg.max_num_seqs
        self.graphs: dict = {}  # bucket size -> replay() returning the bucket's logits
        self.graph_note = "eager (CPU)" if self.device.type != "cuda" else "eager (enforce_eager)"
        self.time_forward = False
        self.last_forward_ms = None
        self.last_used_graph = False
        self.last_enqueued = self.last_sampled = None
        if self.device.type == "cuda" and not getattr(model, "graph_safe", True):
            self.graph_note = "eager decode (the model's MoE routes tokens on the host: no CUDA graphs)"
        elif self.device.type == "cuda" and not ecfg.enforce_eager and ecfg.cuda_graph_sizes:
            self.capture_graphs()

    # ---- inputs ---------------------------------------------------------------------------
    def _slots(self, seq, start: int, n: int) -> list[int]:
        bs, table = self.ecfg.block_size, seq.block_table
        if n == 1:
            return [table[start // bs] * bs + start % bs]
        pos = torch.arange(start, start + n)
        return (torch.tensor(table)[pos // bs] * bs + pos % bs).tolist()

    def _table(self, seqs, multiple: int = 1) -> torch.Tensor:
        """``[len(seqs), max pages]`` int32 block table (zeros past a sequence's pages and for None),
        its width rounded up to ``multiple``."""
        tables = [s.block_table if s is not None else [] for s in seqs]
        width = -(-max([len(t) for t in tables] + [1]) // multiple) * multiple
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

    def _eager_inputs(self, batch: ScheduledBatch):
        ids, pos, slots, rows, qsl, lens = [], [], [], [], [0], []
        for seq, n in zip(batch.seqs, batch.num_new):
            start = seq.num_computed
            ids += seq.token_ids[start:start + n]
            pos += range(start, start + n)
            slots += self._slots(seq, start, n)
            rows += [seq.slot] * n
            qsl.append(qsl[-1] + n)
            lens.append(start + n)
        # a width of 16 pages' multiples: the kernels' row stride then keeps one divisibility
        # class from step to step (Triton specializes integer arguments on divisibility by 16; a
        # changing class compiles another variant of every attention kernel)
        return ids, pos, slots, rows, qsl, lens, self._table(batch.seqs, multiple=16)

    def _decode_inputs(self, layout: list, size: int):
        """Host inputs of a decode batch in ``layout`` order (None: padding), padded to ``size`` rows."""
        ids, pos, slots = [0] * size, [0] * size, [-1] * size
        rows, lens, qsl = [self.padding_row] * size, [1] * size, [0] * (size + 1)
        for r, seq in enumerate(layout):
            if seq is not None:
                p = seq.num_computed
                ids[r], pos[r], rows[r], lens[r] = seq.token_ids[p], p, seq.slot, p + 1
                slots[r] = self._slots(seq, p, 1)[0]
            qsl[r + 1] = qsl[r] + (seq is not None)
        for r in range(len(layout), size):
            qsl[r + 1] = qsl[r]
        return ids, pos, slots, rows, qsl, lens, self._table(layout + [None] * (size - len(layout)))

    def _metadata(self, host, *, plan, decode_rows: int = 0):
        ids, pos, slots, rows, qsl, lens, table = host
        dev = self.device

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

        meta = StepMetadata(
            positions=t(pos, torch.int64), query_start_loc=t(qsl, torch.int32), seq_lens=t(lens, torch.int32),
            block_table=table.to(dev, non_blocking=True), slot_mapping=t(slots, torch.int64),
            cache_rows=t(rows, torch.int64), plan=plan, host_query_start_loc=qsl, host_seq_lens=lens,
            host_rows=[rows[a] for a in qsl[:-1]] if not decode_rows else rows, decode_rows=decode_rows,
        )
        return t(ids, torch.int64), meta

    # ---- forward --------------------------------------------------------------------------
    def _forward(self, input_ids, meta, select=None) -> torch.Tensor:
        self.attn.prepare(meta)
        hidden = self.model(input_ids, meta.positions, self.attn, meta)
        if select is not None:
            hidden = hidden[select]
        return self.model.logits(hidden)

    def _timed(self, fn):
        """``fn()``; when ``time_forward`` is on (CUDA), its GPU time, from after the step's inputs
        were enqueued, goes to ``last_forward_ms``."""
        if not (self.time_forward and self.device.type == "cuda"):
            return fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        self.last_forward_ms = start.elapsed_time(end)
        return out

    def forward(self, batch: ScheduledBatch, *, all_tokens: bool = False) -> torch.Tensor:
        """Logits ``[n, vocab]`` fp32: of each sampling sequence's last token in batch order, or
        (``all_tokens``) of every token of the batch."""
        self.last_used_graph = False
        self.last_forward_ms = None
        if batch.is_decode and not all_tokens:
            return self._decode(batch).float()
        host = self._eager_inputs(batch)
        ids, meta = self._metadata(host, plan=self.attn.step_plan(host[4], host[5], host[6]))
        select = None
        if not all_tokens:
            select = torch.tensor([host[4][i + 1] - 1 for i in range(len(batch.seqs)) if batch.samples(i)],
                                  dtype=torch.int64).to(self.device)
        return self._timed(lambda: self._forward(ids, meta, select)).float()

    def _decode(self, batch: ScheduledBatch) -> torch.Tensor:
        layout = self.attn.decode_layout(batch.seqs)
        row_of = {id(s): r for r, s in enumerate(layout) if s is not None}
        select = [row_of[id(s)] for s in batch.seqs]
        bucket = min((b for b in self.graphs if b >= len(layout)), default=None)
        if bucket is None:
            host = self._decode_inputs(layout, len(layout))
            ids, meta = self._metadata(host, plan=self.attn.step_plan(host[4], host[5], host[6]),
                                       decode_rows=len(layout))
            select = torch.tensor(select, dtype=torch.int64).to(self.device)
            return self._timed(lambda: self._forward(ids, meta, select))
        host = self._decode_inputs(layout, bucket)
        self.graph_inputs.write(host, select)  # enqueued before plan.update's host work, which they overlap
        qsl, lens, n = host[4], host[5], len(layout)
        self.attn.update_graph_plan(self.graph_plan, qsl[:n + 1], lens[:n], bucket=host)
        logits = self._timed(self.graphs[bucket])
        self.last_used_graph = True
        return logits.index_select(0, self.graph_inputs.select[:len(select)])

    def execute(self, batch: ScheduledBatch) -> list[int]:
        """Run one step and return the sampled token of each sequence that samples, in batch order."""
        seqs = [seq for i, seq in enumerate(batch.seqs) if batch.samples(i)]
        logits = self.forward(batch)
        self.last_enqueued = time.perf_counter()  # the host has queued the step's forward
        tokens = self.sampler(logits, seqs) if seqs else []
        if not seqs and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.last_sampled = time.perf_counter()  # the tokens are on the host: the device work is done
        return tokens

    # ---- CUDA graphs ----------------------------------------------------------------------
    def _graph_forward(self, size: int) -> torch.Tensor:
        s = self.static
        meta = StepMetadata(
            positions=s["positions"][:size], query_start_loc=s["query_start_loc"][:size + 1],
            seq_lens=s["seq_lens"][:size], block_table=s["block_table"][:size], slot_mapping=s["slot_mapping"][:size],
            cache_rows=s["cache_rows"][:size], plan=self.graph_plan, decode_rows=size,
        )
        return self._forward(s["input_ids"][:size], meta)

    @torch.inference_mode()
    def capture_graphs(self, *, emulate: bool = False) -> None:
        """Capture one decode graph per bucket, largest first, sharing one memory pool. A failure
        leaves the runner eager and says why in ``graph_note``.

        ``emulate``: no capture; a "replay" runs the same forward over the static buffers (what
        the CPU tests use to check the buffers, the padding and the plan updates of graph decode).
        """
        sizes = sorted(self.ecfg.cuda_graph_sizes, reverse=True)
        top = sizes[0]
        self.graph_inputs = GraphInputs(top, self.pages_per_seq, self.padding_row, self.device)
        self.static = self.graph_inputs.static
        self.graph_plan = self.attn.graph_plan(top, sizes=sizes, pages=self.pages_per_seq)
        self.graphs = {}
        if emulate:
            self.graphs = {size: (lambda size=size: self._graph_forward(size)) for size in sizes}
            self.graph_note = f"emulated decode graphs for batch sizes {sorted(self.graphs)}"
            return
        pool = None
        try:
            for size in sizes:
                self.attn.update_graph_plan(self.graph_plan, list(range(size + 1)), [1] * size,
                                            bucket=self._decode_inputs([], size))
                self._graph_forward(size)  # compiles and autotunes outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._graph_forward(size)
                pool = graph.pool()
                self.graphs[size] = self._replayer(graph, logits)
            self.graph_note = f"decode CUDA graphs for batch sizes {sorted(self.graphs)}"
        except Exception as e:  # noqa: BLE001 - run eagerly and report why
            torch.cuda.synchronize()
            self.graphs = {}
            self.graph_note = f"eager decode (graph capture failed: {type(e).__name__}: {str(e)[:200]})"

    @staticmethod
    def _replayer(graph, logits):
        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay
