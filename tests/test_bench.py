"""The benchmark suite runs end to end (--quick) and its records pass the correctness gate."""

import json
import math

import pytest
import torch

from pagedattn.bench.cli import main


def test_bench_quick_decode_mixed(tmp_path, capsys):
    out = tmp_path / "results.json"
    md = tmp_path / "table.md"
    rc = main(["--quick", "--workload", "decode,mixed", "--provider", "pagedattn",
               "--json", str(out), "--markdown", str(md)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert {"machine", "config", "ceilings", "providers", "records"} <= set(data)
    for key in ("torch", "triton", "date", "gpu", "sm_count"):
        assert key in data["machine"]
    records = data["records"]
    assert {r["workload"] for r in records} == {"decode", "mixed"}
    assert len(records) >= 5
    for r in records:
        assert r["provider"] == "pagedattn"
        assert r["ok"] is True, r
        assert r["status"] == "ok"
        assert math.isfinite(r["time_us"]) and r["time_us"] > 0
        assert r["max_err"] <= r["tolerance"]
        for key in ("gbps", "tflops", "pct_of_ceiling", "ratio_to_best_anchor"):
            assert key in r
    table = md.read_text()
    assert "| decode B=1 L=64 | PASS, err " in table
    captured = capsys.readouterr()
    assert table in captured.out
    # the interpreter is a correctness run: said up front, no GPU-style figures in the table
    assert "correctness run" in captured.err and "correctness run" in table
    assert "GB/s" not in table and "TF/s" not in table
    assert "\r" not in captured.err  # not a terminal: plain progress lines
    assert "[1/" in captured.err and "PASS" in captured.err


def test_hetero_suite_cases_and_floor():
    import torch

    from pagedattn.bench.workloads import SUITES, bytes_floor_us, make_cases, work

    cases = {c.name: c for c in make_cases(SUITES["hetero"])}
    assert set(cases) == {"hetero 2x16384 + 126x512", "hetero 8x8192 + 56x256", "specdecode 16x6@8192"}
    long_short = cases["hetero 2x16384 + 126x512"]
    assert long_short.num_seqs == 128 and long_short.kind == "decode"
    kv = work(long_short, torch.bfloat16)["kv_bytes"]
    assert kv == (2 * 16384 + 126 * 512) * 8 * 128 * 2 * 2
    assert bytes_floor_us(kv) == pytest.approx(86.6, abs=0.1)  # 87 us at 4.6 TB/s
    spec = cases["specdecode 16x6@8192"]
    assert spec.num_tokens == 96 and spec.seq_lens == [8192] * 16
    assert {c.workload for c in make_cases(SUITES["all"])} >= {"decode", "hetero", "specdecode"}


def test_bench_quick_hetero_suite(tmp_path):
    out = tmp_path / "hetero.json"
    assert main(["--quick", "--suite", "hetero", "--provider", "pagedattn", "--json", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert {r["workload"] for r in records} == {"hetero", "specdecode"}
    for r in records:
        assert r["status"] == "ok" and r["ok"] is True, r
        assert r["bytes_floor_us"] > 0


def test_report_gpu_table_shows_bytes_floor():
    from pagedattn.bench.report import markdown_table

    rec = dict(case="hetero 2x16384 + 126x512", provider="pagedattn", kind="decode", status="ok", time_us=100.0,
               tflops=1.0, gbps=3984.0, pct_of_ceiling=None, anchor=False, ratio_to_best_anchor=None,
               method="cudagraph", bytes_floor_us=86.6, x_bytes_floor=100.0 / 86.6)
    results = dict(machine=dict(device="cuda:0", gpu="H200", sm_count=132, torch="t", triton="t", date="d",
                                triton_interpret=False),
                   config=dict(dtype="bf16"), ceilings={}, records=[rec])
    table = markdown_table(results)
    assert "| case | bytes floor | pagedattn |" in table
    assert "| hetero 2x16384 + 126x512 | 86.6 us | 100.0 us, 3984 GB/s, 1.15x floor |" in table


def test_bench_rejects_unknown_names(tmp_path):
    with pytest.raises(SystemExit):
        main(["--quick", "--workload", "nope", "--json", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit):
        main(["--quick", "--provider", "nope", "--json", str(tmp_path / "r.json")])


def test_under_load_needs_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: --under-load runs")
    with pytest.raises(SystemExit):
        main(["--quick", "--under-load", "--json", str(tmp_path / "r.json")])
    assert "--under-load" in capsys.readouterr().err


def test_workload_counts():
    import torch

    from pagedattn.bench.workloads import make_cases, work

    cases = {c.name: c for c in make_cases()}
    assert "decode B=128 L=32768" in cases  # B*L = 4M tokens, the limit, is kept
    prefill = work(cases["prefill S=2048"], torch.bfloat16)
    assert prefill["flops"] == 4 * 32 * 2048 * 2048 * 128 / 2
    decode = work(cases["decode B=8 L=4096"], torch.bfloat16)
    assert decode["kv_bytes"] == 8 * 4096 * 8 * 128 * 2 * 2
    gptoss = work(cases["gptoss decode B=32 L=4096"], torch.bfloat16)
    assert gptoss["kv_bytes"] == 32 * 128 * 8 * 64 * 2 * 2  # only the window is read


def test_bench_quick_mixes_of_prefill_extend_and_decode(tmp_path):
    out = tmp_path / "mixes.json"
    rc = main(["--quick", "--workload", "prefill-heavy,decode-heavy,mixed", "--provider", "pagedattn",
               "--json", str(out)])
    assert rc == 0
    records = json.loads(out.read_text())["records"]
    assert {r["workload"] for r in records} == {"prefill-heavy", "decode-heavy", "mixed"}
    assert len(records) == 3
    for r in records:
        assert r["status"] == "ok" and r["ok"] is True, r
        assert math.isfinite(r["time_us"]) and r["time_us"] > 0


def test_models_suite_steps_on_the_graph_plan(tmp_path):
    # Gemma-3's local (window) and global layers', Llama-3.1-8B's and Mistral-7B's (window and
    # none) decode steps at vLLM's grid points, on the automatic plan and on the persistent plan
    # vLLM's builder makes for its graphs; the graph plan declines a prefill.
    import torch

    from pagedattn.bench.workloads import SUITES, make_cases, work

    full = {c.name: c for c in make_cases(SUITES["models"])}
    assert set(full) == {f"gemma3 {kind} decode B={b} L={ctx}" for kind in ("local", "global")
                         for b, ctx in ((1, 512), (16, 4096), (64, 2048))} | {
                         f"llama3 decode B={b} L={ctx}" for b, ctx in ((1, 512), (16, 4096), (64, 2048), (128, 1024))} | {
                         f"llama3 {cache} cache decode B={b} L={ctx}"
                         for cache in ("engine", "engine-interleaved", "engine-scattered")
                         for b, ctx in ((16, 4097), (64, 2049))} | {"llama3 traffic decode B=64 L=90-4300"} | {
                         "llama3 traffic chunk step 56x1+3000+2000+3136", "llama3 traffic chunk decodes 56x1",
                         "llama3 traffic chunk prompts 3000+2000+3136"} | {
                         f"mistral {w}decode B={b} L={ctx}" for w in ("", "no-window ") for b, ctx in ((16, 4224), (64, 2048))}
    win, no_win = full["mistral decode B=16 L=4224"], full["mistral no-window decode B=16 L=4224"]
    assert win.params["sliding_window"] == 4096 and no_win.params["sliding_window"] is None
    assert work(win, torch.bfloat16)["kv_bytes"] < work(no_win, torch.bfloat16)["kv_bytes"]
    traffic = full["llama3 traffic decode B=64 L=90-4300"]
    assert traffic.num_seqs == 64 and 90 <= min(traffic.seq_lens) < max(traffic.seq_lens) <= 4300
    # the chunk step fills vLLM's 8192-token budget; its two parts are its decodes and its prompts
    chunk = full["llama3 traffic chunk step 56x1+3000+2000+3136"]
    decodes, prompts = full["llama3 traffic chunk decodes 56x1"], full["llama3 traffic chunk prompts 3000+2000+3136"]
    assert chunk.num_tokens == 8192 and chunk.segments == decodes.segments + prompts.segments
    assert decodes.seq_lens == traffic.seq_lens[:56]
    local, glob = full["gemma3 local decode B=16 L=4096"], full["gemma3 global decode B=16 L=4096"]
    assert local.params["sliding_window"] == 1024 and glob.params["sliding_window"] is None
    assert work(glob, torch.bfloat16)["kv_bytes"] == 4 * work(local, torch.bfloat16)["kv_bytes"]
    out = tmp_path / "models.json"
    assert main(["--quick", "--suite", "models", "--workload", "gemma3,llama3,mistral,mixed", "--provider", "pagedattn,pagedattn-graph",
                 "--json", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    graph = {r["case"]: r for r in records if r["provider"] == "pagedattn-graph"}
    assert {c for c, r in graph.items() if r["status"] == "ok" and r["ok"]} == {
        "gemma3 local decode B=2 L=64", "gemma3 global decode B=2 L=64", "llama3 decode B=2 L=64",
        "llama3 decode B=4 L=32", "llama3 engine cache decode B=2 L=65", "llama3 engine-interleaved cache decode B=2 L=65",
        "llama3 engine-scattered cache decode B=2 L=65",
        "llama3 traffic decode B=6 L=8-200", "mistral decode B=2 L=40", "mistral no-window decode B=2 L=40",
        "mistral decode B=4 L=16", "mistral no-window decode B=4 L=16", "llama3 traffic chunk decodes 6x1"}
    assert graph["mixed 1x32+3x1@33"]["status"] == "skip"
    auto = {r["case"]: r for r in records if r["provider"] == "pagedattn"}
    assert all(auto[c]["status"] == "ok" and auto[c]["ok"] for c in auto if "chunk" in c), auto


def test_report_marks_eager_timing_after_failed_capture():
    from pagedattn.bench.report import markdown_table

    rec = dict(case="c", provider="sdpa", kind="mixed", status="ok", time_us=12.0, tflops=1.0, gbps=1.0,
               pct_of_ceiling=None, anchor=False, ratio_to_best_anchor=None,
               method="do_bench (graph capture failed: RuntimeError: sync)")
    results = dict(machine=dict(device="cuda", gpu="H200", sm_count=132, torch="t", triton="t", date="d"),
                   config=dict(dtype="bf16"), ceilings={}, records=[rec])
    table = markdown_table(results)
    assert "12.0 us, 1 TF/s (eager: no graph)" in table
    assert "- sdpa on c: timed eagerly, do_bench (graph capture failed: RuntimeError: sync)" in table



def _timed(provider, us, method, graph_us=None):
    rec = dict(case="mixed", provider=provider, status="ok", time_us=us, method=method, n_copies=1,
               kv_bytes=1e9, flops=1e12)
    return rec if graph_us is None else {**rec, "graph_us": graph_us}


@pytest.mark.parametrize("cache", ["engine", "engine-interleaved"])
def test_engine_cache_cases_lay_pages_out_as_vllm_does(cache):
    # one allocation ENGINE_POOL_FACTOR x the batch's blocks, block 0 unused, each sequence's pages
    # in order after the last one's; K and V as the engine's two layouts view them
    import torch

    from pagedattn.bench.workloads import ENGINE_POOL_FACTOR, LLAMA, _case, build_inputs

    case = _case("c", "llama3", "decode", [(3, 1, 40)], dict(LLAMA, num_q_heads=4, num_kv_heads=2, head_size=32),
                 cache=cache)
    x = build_inputs(case, torch.device("cpu"), torch.float32)
    assert x.block_table.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert x.k_cache.shape == x.v_cache.shape == (ENGINE_POOL_FACTOR * 9 + 1, 16, 2, 32)
    assert x.k_cache.untyped_storage().data_ptr() == x.v_cache.untyped_storage().data_ptr()
    assert (x.v_cache.data_ptr() - x.k_cache.data_ptr()) // 4 == (32 if cache == "engine-interleaved" else x.k_cache.numel())
    with pytest.raises(ValueError, match="cache must be one of"):
        _case("c", "llama3", "decode", [(1, 1, 8)], LLAMA, cache="paged")


def test_scattered_engine_cache_draws_distinct_pages_from_the_whole_pool():
    import torch

    from pagedattn.bench.workloads import ENGINE_POOL_FACTOR, LLAMA, _case, build_inputs

    shape = dict(LLAMA, num_q_heads=4, num_kv_heads=2, head_size=32)
    case = _case("c", "llama3", "decode", [(8, 1, 160)], shape, cache="engine-scattered")
    x = build_inputs(case, torch.device("cpu"), torch.float32)
    pages = x.block_table.flatten().tolist()
    pool = ENGINE_POOL_FACTOR * 80 + 1
    assert x.k_cache.shape[0] == pool and x.v_cache.data_ptr() - x.k_cache.data_ptr() == 32 * 4
    assert len(set(pages)) == 80 and 0 not in pages and max(pages) < pool
    assert max(pages) > 80  # beyond the first sixth, where the in-order layouts stay


def test_a_case_is_timed_one_way():
    """Where every provider of a case was replayed, the do_bench readings give way to the
    replays (kept beside them); a provider never captured leaves the row as it was."""
    from pagedattn.bench.cli import _one_method

    records = [_timed("pagedattn", 261.8, "do_bench", graph_us=226.4),
               _timed("pagedattn-gluon", 226.8, "cudagraph x1 copies"), dict(provider="x", status="skip")]
    _one_method(records, {})
    assert [r.get("time_us") for r in records] == [226.4, 226.8, None]
    assert records[0]["do_bench_us"] == 261.8 and records[0]["method"].startswith("cudagraph x1")
    assert records[0]["tflops"] == pytest.approx(1e12 / 226.4e-6 / 1e12)
    never = [_timed("a", 1300.0, "do_bench"), _timed("b", 970.0, "do_bench", graph_us=972.1)]
    _one_method(never, {})
    assert [r["time_us"] for r in never] == [1300.0, 970.0] and "do_bench_us" not in never[1]


WAVES_ROWS = [
    dict(batch=b, context=ctx, schedule=sched, persistent_us=p, persistent_err=1e-3,
         **(dict(variable_grid_us=v, best_true_size_us=best, best_true_size_eager_us=best + 5,
                 true_size_path="split_kv x4") if sched == "static" else {}))
    for b, ctx, v, best in ((1, 500, 30.9, 11.3), (8, 4096, 209.2, 72.3), (64, 2048, 232.6, 247.5))
    for sched, p in (("static", 1.1 * best), ("atomic", 1.2 * best))
]


def _waves_file(tmp_path, layout):
    src = tmp_path / "waves.json"
    if layout == "results":
        src.write_text(json.dumps({"machine": {"gpu": "H200", "torch": "2.11", "triton": "3.6"},
                                   "capture": {"max_seqs": 256, "max_context": 8192}, "rows": WAVES_ROWS}))
    elif layout == "bare-list":
        src.write_text(json.dumps(WAVES_ROWS))
    else:
        src.write_text("\n".join(json.dumps(r) for r in WAVES_ROWS) + "\n\n| replay | table |\n")
    return src


@pytest.mark.parametrize("layout", ["results", "bare-list", "log-lines"])
def test_waves_rows_from_each_layout(tmp_path, layout):
    from pagedattn.bench.plot import load_waves, waves_cases

    cases = waves_cases(load_waves(_waves_file(tmp_path, layout).read_text())["rows"])
    assert [(c["batch"], c["context"]) for c in cases] == [(1, 500), (8, 4096), (64, 2048)]
    assert cases[1]["persistent_atomic_us"] == pytest.approx(1.2 * 72.3) and cases[1]["variable_grid_us"] == 209.2


def test_waves_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from pagedattn.bench.plot import main as plot_main

    assert plot_main([str(_waves_file(tmp_path, "results")), "--out", str(tmp_path / "plots")]) == 0
    png = tmp_path / "plots" / "waves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch, capsys):
    import sys

    from pagedattn.bench.plot import main as plot_main

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot_main([str(_waves_file(tmp_path, "results")), "--out", str(tmp_path / "plots")]) == 0
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "plots").exists()


def test_host_timer_runs_every_row_once_a_round():
    """The rows' runs interleave (a, a, b, b per round at 2 calls a run), after the warm-up of
    each; every row gets the median, the best and all of its runs."""
    from pagedattn.bench.host import HostTimer

    order = []
    timer = HostTimer(torch.device("cpu"), calls=2, runs=3, warmup=1)
    rows = [{"name": "a"}, {"name": "b"}]
    for row in rows:
        timer.add(row, lambda name=row["name"]: order.append(name))
    timer.measure()
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 3
    for row in rows:
        assert len(row["host_us_runs"]) == 3 and row["host_us_best"] <= row["host_us"]
        assert row["host_us_best"] == pytest.approx(min(row["host_us_runs"]), abs=0.01)


def test_bench_host_quick(tmp_path, capsys):
    from pagedattn.bench.host import main as host_main

    out, md = tmp_path / "host.json", tmp_path / "host.md"
    assert host_main(["--case", "decode", "--no-write-kv", "--json", str(out), "--markdown", str(md)]) == 0
    rows = json.loads(out.read_text())["rows"]
    paths = [r["path"] for r in rows]
    assert paths == ["unified", "split_kv", "persistent", "auto", "planless", "varlen, no plan", "mla_decode"]
    for r in rows:
        assert r["ok"] is True, r
        assert r["host_us"] > 0 and r["gpu_us"] is None
    table = md.read_text()
    assert "interpreter numbers" in table and "| paged_attention | decode B=2 L=64 | no plan | PASS |" in table
    assert "correctness run" in capsys.readouterr().err


def test_gluon_providers_only_when_named(capsys):
    """The Gluon prefill variants and the tl-only column are columns only when --provider names
    them; --list shows them apart, the Gluon ones with why they are unavailable off an sm90 GPU."""
    from pagedattn.bench.providers import GLUON_VARIANT_COLUMNS, PROVIDERS
    from pagedattn.ops.prefill_gluon.launch import GLUON_PREFILL_CONFIGS

    gluon = [n for n in PROVIDERS if n.startswith("pagedattn-gluon")]
    # the default config's column, then one per kept variant, each a config PAGEDATTN_PREFILL_GLUON names
    assert gluon == ["pagedattn-gluon"] + [f"pagedattn-gluon-{v}" for v in GLUON_VARIANT_COLUMNS]
    assert {"split", "pipelined", "serial", "tma", "tma128-earlyk-1w"} <= set(GLUON_VARIANT_COLUMNS)
    assert set(GLUON_VARIANT_COLUMNS) <= set(GLUON_PREFILL_CONFIGS) - {"1", "0"}
    assert not any(PROVIDERS[n].by_default for n in gluon + ["pagedattn-tl"])
    assert main(["--quick", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "provider pagedattn-tl (only when named): available" in listed
    for n in gluon:
        assert f"provider {n} (only when named):" in listed
        if not torch.cuda.is_available():
            assert "compute capability 9.x only" in listed


def test_compiled_kernels_unwraps_and_lists_every_build():
    """Each compiled build of a JIT function, through its wrappers, on every device; nothing for
    an interpreted kernel (no compile cache)."""
    from types import SimpleNamespace

    from pagedattn.bench.report import compiled_kernels
    from pagedattn.ops.persistent.kernel import persistent_attention_kernel

    a, b, c = object(), object(), object()
    jit = SimpleNamespace(device_caches={0: ({"k1": a, "k2": b}, None), 1: ({"k1": c}, None)})
    wrapped = SimpleNamespace(fn=SimpleNamespace(fn=jit))
    assert compiled_kernels(wrapped) == [(0, "k1", a), (0, "k2", b), (1, "k1", c)]
    assert compiled_kernels(SimpleNamespace(fn=lambda: None)) == []
    if not hasattr(persistent_attention_kernel, "device_caches"):  # decorated under TRITON_INTERPRET=1
        assert compiled_kernels(persistent_attention_kernel) == []
