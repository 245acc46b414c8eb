"""``pagedattn bench serve --quick`` on the CPU: the trace runs through the engine for each
attention, the records carry the serving metrics, and unavailable attentions say why."""

import argparse
import json
import math

import pytest

from pagedattn.bench import serve


def run(argv) -> int:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return serve.main(p.parse_args(argv))


def test_serve_quick(tmp_path, capsys):
    out = tmp_path / "serve.json"
    assert run(["--quick", "--attention", "pagedattn,sdpa", "--attention", "flashinfer", "--json", str(out),
                "--markdown", str(tmp_path / "serve.md")]) == 0
    results = json.loads(out.read_text())
    assert results["note"] and "interpreter" in results["note"]
    recs = {r["attention"]: r for r in results["records"]}
    assert list(recs) == ["pagedattn", "sdpa", "flashinfer"]
    assert recs["flashinfer"]["status"].startswith("not available")
    n = results["config"]["num_requests"]
    for name in ("pagedattn", "sdpa"):
        r = recs[name]
        assert r["status"] == "ok" and r["requests"] == n
        assert r["output_tok_s"] > 0 and r["wall_s"] > 0
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and 0 < r["tpot_p50_ms"] <= r["tpot_p99_ms"]
        assert 0 < r["host_share"] <= 1
        assert r["mixed_steps"] > 0 and r["decode_steps"] > 0  # chunked prefill beside decodes, then decodes
    assert recs["pagedattn"]["output_tokens"] == recs["sdpa"]["output_tokens"]  # the same trace
    md = (tmp_path / "serve.md").read_text()
    assert "| attention | output tok/s |" in md and "interpreter numbers" in md
    assert "interpreter numbers" in capsys.readouterr().err


def test_trace_and_percentiles():
    trace = serve.make_trace(200, (128, 8192), (32, 512), math.inf, 1000, seed=1)
    lens = [len(r["prompt"]) for r in trace]
    assert min(lens) >= 128 and max(lens) <= 8192 and min(lens) < 256 and max(lens) > 4096
    assert all(32 <= r["output_len"] <= 512 and r["offset_s"] == 0 for r in trace)
    assert serve.make_trace(200, (128, 8192), (32, 512), math.inf, 1000, seed=1) == trace  # seeded
    timed = serve.make_trace(50, (4, 8), (2, 2), 10.0, 100, seed=2)
    offsets = [r["offset_s"] for r in timed]
    assert offsets == sorted(offsets) and offsets[0] == 0 and 2 < offsets[-1] < 10  # about 49 / 10 s
    assert serve.percentile([3, 1, 2], 50) == 2 and serve.percentile([1, 2], 99) == pytest.approx(1.99)
    assert serve.percentile([], 50) is None


def test_serve_bad_input(capsys):
    assert run(["--quick", "--attention", "flash"]) == 2
    assert "unknown attention" in capsys.readouterr().err
    assert run(["--quick", "--num-requests", "0"]) == 2
    assert "--num-requests must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run(["--quick", "--prompt-len", "9:3"])


@pytest.mark.parametrize("prompt_len", [(128, 2048), (128, 8192)])
def test_warmup_reaches_a_mixed_step_of_decodes_and_long_chunks(prompt_len):
    """The warm-up traces, scheduled as the engine schedules them (2048 tokens a step), hold a
    step whose long chunks (prefill kernel) run beside decodes only: the unified kernel's decode
    tiles, which the measured trace otherwise compiled on a cold cache."""
    from pagedattn.engine.block_manager import BlockManager
    from pagedattn.engine.config import EngineConfig
    from pagedattn.engine.scheduler import Scheduler
    from pagedattn.engine.sequence import SamplingParams, Sequence
    from pagedattn.plan import PREFILL_MIN_QUERY_LEN

    traces = serve.warmup_traces(8, prompt_len, 1000, seed=1)
    assert len(traces) == 2 and len(traces[0]) == 8
    longest = max(len(r["prompt"]) + r["output_len"] for t in traces for r in t)
    cfg = EngineConfig(max_model_len=longest, max_num_seqs=64, max_num_batched_tokens=2048, block_size=16)
    kinds = []
    for trace in traces:
        sched = Scheduler(cfg, BlockManager(cfg.num_blocks, cfg.block_size))
        for r in trace:
            sched.add(Sequence(r["prompt"], SamplingParams(max_tokens=r["output_len"], ignore_eos=True)))
        while sched.has_unfinished():
            batch = sched.schedule()
            rest = [n for n in batch.num_new if n < PREFILL_MIN_QUERY_LEN]
            if batch.num_decode and len(rest) < len(batch.num_new):
                kinds.append("decodes only" if all(n == 1 for n in rest) else "decodes and short chunks")
            sched.postprocess(batch, [7] * sum(batch.samples(i) for i in range(len(batch.seqs))))
    assert "decodes only" in kinds, kinds
