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
