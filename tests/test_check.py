"""pagedattn check and the pagedattn command: coverage of the default, streaming, JSON, exit codes."""

import io
import json

import pytest
import torch

import pagedattn.check as check
from pagedattn.terminal import Progress
from pagedattn.cli import main as cli_main
from pagedattn.testing import FEATURES
from tests.conftest import DEVICE


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_default_covers_every_family_and_feature(device):
    specs = check.default_specs(device)
    families = {s.family for s in specs}
    assert families == {"attention", "varlen", "merge", "write_kv", "mla", "write_mla_kv"}
    assert {s.path for s in specs if s.family == "attention"} == set(check.ATTENTION_PATHS)
    features = {part for s in specs for part in s.feature.split("+")}
    assert set(FEATURES) - {"scale"} <= features  # "scale" rides with softcap (feature_kwargs)
    assert any(s.cache_dtype == torch.float8_e4m3fn and s.family == "attention" for s in specs)
    assert any(s.cache_dtype == torch.float8_e4m3fn and s.family == "write_kv" for s in specs)
    assert any(s.options.get("batch_invariant") for s in specs)
    assert any(s.options.get("update") for s in specs)  # persistent plan re-planned in place
    assert any(s.shape.get("head_size") in (24, 80) for s in specs)  # not a power of two
    assert any(s.shape.get("num_kv_heads") == 1 for s in specs)  # MQA beside the default GQA
    assert len({s.name for s in specs}) == len(specs)
    # few kernel specializations, so a GPU compiles the default in well under a minute
    assert len(specs) <= 60
    assert len(check.full_specs(device)) > 4 * len(specs)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_row_names_a_batch_of_its_device(device):
    batches = check._device_config(device)["batches"]
    for s in check.default_specs(device) + check.full_specs(device):
        if s.batch != "-":
            assert s.batch in batches, (s.name, device)


def test_check_streams_rows_and_writes_json(tmp_path, capsys):
    out = tmp_path / "check.json"
    rc = check.main(["--only", "merge halves", "--only", "write_kv", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    lines = text.splitlines()
    estimate = next(i for i, l in enumerate(lines) if "checks against the float64 reference; about" in l)
    first_row = next(i for i, l in enumerate(lines) if "[1/4," in l)
    assert estimate < first_row  # the duration is announced before anything runs
    rows = [l for l in lines if " s]" in l and l.strip()[0].isdigit()]
    assert len(rows) == 4 and all(" PASS " in l for l in rows)
    assert [l.split()[1] for l in rows] == ["merge", "merge", "write_kv", "write_kv"]
    assert "\r" not in text  # not a terminal: plain lines only
    assert "4 passed, 0 failed" in text
    data = json.loads(out.read_text())
    assert data["passed"] == 4 and data["failed"] == 0
    assert {"torch", "triton", "device"} <= set(data["machine"])
    assert [r["family"] for r in data["rows"]] == ["merge", "merge", "write_kv", "write_kv"]
    assert all(r["ok"] and r["status"] == "PASS" and r["seconds"] >= 0 for r in data["rows"])


def test_rows_are_printed_as_they_finish(monkeypatch):
    stream = io.StringIO()
    seen = []
    real = check.RUNNERS["merge"]

    def runner(spec, device, g):
        seen.append(stream.getvalue().count(" PASS "))  # rows already printed when this one starts
        return real(spec, device, g)

    monkeypatch.setitem(check.RUNNERS, "merge", runner)
    specs = [s for s in check.default_specs(DEVICE) if s.family == "merge" and not s.options]
    rows = check.run_check(DEVICE, specs=specs, stream=stream)
    assert seen == list(range(len(specs))) and all(r["ok"] for r in rows)


def test_a_wrong_kernel_fails_the_check(monkeypatch, capsys):
    import pagedattn.api

    monkeypatch.setattr(pagedattn.api, "write_kv", lambda *a, **k: None)  # writes nothing
    assert check.main(["--only", "write_kv"]) == 1
    text = capsys.readouterr().out
    assert "FAIL" in text and "0 passed, 2 failed" in text


def test_an_error_in_a_row_is_reported_and_the_run_goes_on(monkeypatch):
    def boom(spec, device, g):
        raise RuntimeError("kernel exploded")

    monkeypatch.setitem(check.RUNNERS, "write_mla_kv", boom)
    specs = [s for s in check.default_specs(DEVICE) if s.family in ("write_mla_kv", "merge")]
    rows = check.run_check(DEVICE, specs=specs, quiet=True)
    errors = [r for r in rows if r["status"] == "ERROR"]
    assert len(errors) == 2 and "kernel exploded" in errors[0]["note"]
    assert all(r["ok"] for r in rows if r["family"] == "merge")


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the message on a machine without CUDA")
def test_device_cuda_without_cuda_is_a_clear_error(capsys):
    assert check.main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device is available" in err and "Traceback" not in err


def test_progress_redraws_on_a_terminal_only():
    tty = io.StringIO()
    p = Progress(2, stream=tty, live=True)
    p.start("first")
    p.done("row 1")
    p.start("second")
    p.close()
    assert "\r" in tty.getvalue() and "[1/2]" in tty.getvalue() and "row 1\n" in tty.getvalue()
    log = io.StringIO()
    p = Progress(2, stream=log)  # StringIO is not a terminal
    p.start("first")
    p.done("row 1")
    p.step("second")
    p.close()
    assert log.getvalue() == "row 1\n[2/2] second (0 s)\n"


def test_version(capsys):
    assert cli_main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("pagedattn ") and "torch" in out and "triton" in out


@pytest.mark.parametrize("argv", [["--help"], ["check", "--help"], ["bench", "--help"], ["bench", "kernels", "--help"],
                                  ["bench", "host", "--help"], ["bench", "plot", "--help"]])
def test_help_is_plain_text(argv, capsys):
    try:
        rc = cli_main(argv)
    except SystemExit as e:  # argparse's --help
        rc = e.code
    assert rc == 0
    out = capsys.readouterr().out
    assert out.strip() and "`" not in out and ":func:" not in out


def test_bench_subcommands_dispatch(monkeypatch, capsys):
    import pagedattn.cli as cli

    assert set(cli.BENCHMARKS) >= {"kernels", "e2e", "serve", "mla", "host", "plot", "tune", "waves"}
    monkeypatch.setitem(cli.BENCHMARKS, "serve", ("pagedattn.bench.not_there", False))
    assert cli_main(["bench", "serve"]) == 2
    assert "not available" in capsys.readouterr().err
    assert cli_main(["bench", "nope"]) == 2
    if DEVICE == "cpu":
        assert cli_main(["bench", "tune"]) == 2
        assert "needs a GPU" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["generate", "--model", "tiny", "--prompt", "hi"], ["bench", "e2e", "--quick"],
                                  ["bench", "serve", "--quick"]])
def test_engine_commands_say_what_to_install_without_transformers(argv, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # "import transformers" fails, as when not installed
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "needs transformers" in err and 'pip install -e ".[engine]"' in err


def test_the_engine_extra_provides_what_the_engine_imports():
    import tomllib
    from pathlib import Path

    from pagedattn.engine.config import ENGINE_PACKAGES

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    extra = {req.split(">")[0].split("=")[0].split("<")[0].strip() for req in project["optional-dependencies"]["engine"]}
    assert set(ENGINE_PACKAGES) <= extra


def test_engine_benchmarks_on_the_cpu_promise_no_pass_fail(monkeypatch, capsys):
    import pagedattn.cli as cli
    import pagedattn.terminal as terminal

    monkeypatch.setattr(cli, "gpu_present", lambda: False)
    monkeypatch.setitem(cli.BENCHMARKS, "e2e", ("pagedattn.bench.not_there", False))
    monkeypatch.setattr(cli.importlib, "import_module", lambda name: type("M", (), {"main": staticmethod(lambda rest: 0)}))
    assert cli_main(["bench", "e2e"]) == 0
    err = capsys.readouterr().err
    assert terminal.ENGINE_INTERPRETER_BANNER in err and "pass/fail" not in err


def test_nan_rows_must_match_the_reference_pattern():
    ref_out = torch.randn(3, 2, 4, dtype=torch.float64)
    ref_lse = torch.randn(3, 2, dtype=torch.float64)
    ref_out[1, 0], ref_lse[1, 0] = float("nan"), float("nan")  # the row that read a NaN
    out, lse = ref_out.to(torch.float32).clone(), ref_lse.to(torch.float32).clone()
    assert check._poisoned_result(out, lse, ref_out, ref_lse)["ok"]
    spread = out.clone()
    spread[2, 1, 0] = float("nan")  # a row that read no NaN
    assert not check._poisoned_result(spread, lse, ref_out, ref_lse)["ok"]
    hidden = out.clone()
    hidden[1, 0] = 0.0  # the NaN dropped: output looks finite
    assert not check._poisoned_result(hidden, lse, ref_out, ref_lse)["ok"]
    assert not check._poisoned_result(ref_out.float(), ref_lse.nan_to_num(0.0).float(), ref_out, ref_lse)["ok"]


def test_merge_keeps_a_nan_state():
    specs = [s for s in check.default_specs(DEVICE) if s.family == "merge" and s.options.get("poison")]
    [row] = check.run_check(DEVICE, specs=specs, quiet=True)
    assert row["ok"] and "NaN out and lse" in row["note"]
