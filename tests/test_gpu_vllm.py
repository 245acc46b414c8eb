"""pagedattn inside vLLM on a GPU: log-probabilities against vLLM's own backends, and a check that
a broken backend is caught.

Each backend runs in a fresh process (tests/vllm_logprobs.py) on a small model with random
weights (Llama's shape with grouped heads; Mistral's, one sliding window on every layer; Gemma-2's,
windowed and global layers in turn with a logit cap and its own scale; GPT-OSS's, windowed and
global layers in turn with a sink logit a head, its MoE through vLLM's fused-MoE kernels;
DeepSeek's latent attention at 16 and at 128 heads: the portable and, on sm90, the Gluon MLA
decode kernel), eager. Per prompt token and per decode step (top-20 log-probabilities, while the greedy tokens
agree) the largest difference from a reference backend is taken. vLLM's two reference backends
differ from each other by some amount ``d_ref`` (bf16 kernels that round differently); pagedattn
must stay within ``max(2 d_ref, FLOOR)`` of the first, and pagedattn with its softmax scale
doubled must not.

Needs vLLM installed where ``VLLM_SITE`` (default /tmp/site) points, as ../shared/vllm-gpu's
recipe installs it on the GPU machine; skipped otherwise.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
SITE = os.environ.get("VLLM_SITE", "/tmp/site")
FLOOR = 0.02  # log-probability; bf16 logits over a 512-token vocabulary
MIN_DECODE_STEPS = 8  # decode steps compared in all, over the prompts

if not (pathlib.Path(SITE) / "vllm").is_dir():
    pytest.skip(f"vLLM is not installed under VLLM_SITE={SITE} (../shared/vllm-gpu/README.md installs it there)",
                allow_module_level=True)


def _env() -> dict:
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join([SITE, str(ROOT)]), VLLM_ENABLE_V1_MULTIPROCESSING="0",
               HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_USE_FLASHINFER_SAMPLER="0")
    env.pop("TRITON_INTERPRET", None)
    return env


def _worker(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.vllm_logprobs", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _logprobs(model_dir, backend: str, broken: bool = False, required: bool = True) -> dict | None:
    """The worker's JSON; None when a backend not ``required`` does not start on this machine."""
    proc = _worker("run", str(model_dir), "--backend", backend, *(["--broken"] if broken else []))
    if proc.returncode != 0:
        if required:
            raise AssertionError(f"{backend}{' (broken)' if broken else ''} failed in vLLM:\n{proc.stderr[-4000:]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _difference(a: dict, b: dict) -> tuple[float, int]:
    """(largest |log-probability difference|, decode steps compared) between two runs."""
    worst, steps = 0.0, 0
    for pa, pb in zip(a["prompts"], b["prompts"]):
        for x, y in zip(pa["prompt_logprobs"], pb["prompt_logprobs"]):
            if x is not None and y is not None:
                worst = max(worst, abs(x - y))
        for i, (sa, sb) in enumerate(zip(pa["steps"], pb["steps"])):
            common = set(sa) & set(sb)
            worst = max([worst] + [abs(sa[t] - sb[t]) for t in common if math.isfinite(sa[t] + sb[t])])
            steps += 1
            if pa["tokens"][i] != pb["tokens"][i]:
                break  # the greedy paths part here: later steps see different tokens
    return worst, steps


@pytest.fixture(scope="module", params=["llama", "mistral", "gemma2", "gpt-oss", "deepseek", "deepseek-128"])
def case(request, tmp_path_factory):
    kind = request.param
    if kind == "gpt-oss" and not any((pathlib.Path(SITE) / "vllm").glob("_moe_C*")):
        pytest.skip("vLLM was installed without its fused-MoE kernels (../shared/vllm-gpu: fetch_wheels.sh --with-moe)")
    model_dir = tmp_path_factory.mktemp(kind)
    proc = _worker("make", str(model_dir), "--kind", kind)
    assert proc.returncode == 0, proc.stderr[-4000:]
    refs = ("TRITON_MLA", "FLASHMLA") if kind.startswith("deepseek") else ("FLASH_ATTN", "TRITON_ATTN")
    return kind, model_dir, refs


def test_logprobs_match_vllms_backends_and_a_broken_backend_is_caught(case):
    kind, model_dir, (ref_name, ref2_name) = case
    ref = _logprobs(model_dir, ref_name)
    ref2 = _logprobs(model_dir, ref2_name, required=False)
    d_ref = _difference(ref, ref2)[0] if ref2 is not None else 0.0
    bound = max(2 * d_ref, FLOOR)
    d_custom, steps = _difference(ref, _logprobs(model_dir, "CUSTOM"))
    print(f"{kind}: |{ref2_name} - {ref_name}| {d_ref:.4f}, |CUSTOM - {ref_name}| {d_custom:.4f} over {steps} "
          f"decode steps, bound {bound:.4f}", flush=True)
    assert steps >= MIN_DECODE_STEPS, f"only {steps} decode steps compared (the greedy paths parted early)"
    assert d_custom <= bound, f"pagedattn differs from {ref_name} by {d_custom:.4f} > {bound:.4f}"
    d_broken, _ = _difference(ref, _logprobs(model_dir, "CUSTOM", broken=True))
    print(f"{kind}: |broken - {ref_name}| {d_broken:.4f}", flush=True)
    assert d_broken > bound, f"a doubled softmax scale differs by only {d_broken:.4f}: the check cannot tell"
