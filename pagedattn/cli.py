"""The pagedattn command: check, bench (kernels, e2e, serve, mla, host, plot, tune, waves) and generate.

The terminal helpers the commands share (progress, the interpreter banner) are in
:mod:`pagedattn.terminal`.
"""

from __future__ import annotations

import importlib
import os
import re
import sys

from pagedattn.terminal import gpu_present, interpreter_banner

USAGE = """usage: pagedattn <command> [options]
       pagedattn --version

commands:
  check            check every kernel family and feature against the float64 reference
                   on this machine (about a minute on a GPU, 20-35 s on a CPU); "check --compile"
                   compiles every kernel variant for NVIDIA and AMD targets without running them
  bench            benchmarks; "pagedattn bench --help" lists them:
                     kernels (the default), e2e, serve, mla, host, plot, tune, waves
  generate         generate text with the built-in engine

"pagedattn <command> --help" shows a command's options.
"""

BENCH_USAGE = """usage: pagedattn bench [<benchmark>] [options]

benchmarks:
  kernels   time the reference workloads per provider, each checked first (the default:
            "pagedattn bench --quick" is "pagedattn bench kernels --quick")
  e2e       the engine end to end (prefill, decode TPOT) with pagedattn and SDPA attention
  serve     a synthetic serving trace through the engine (tokens/s, TTFT, TPOT)
  mla       MLA decode beside a torch implementation
  host      host time and GPU time of one call per path (the per-layer overhead)
  plot      plots from a kernels or waves results file
  tune      sweep the decode tiles and split counts (GPU)
  waves     one CUDA graph captured at the maximum batch, replayed at smaller ones (GPU)

"pagedattn bench <benchmark> --help" shows its options. Without a GPU every benchmark runs in
Triton's interpreter on small shapes: a correctness run, whose timings mean nothing.
"""

# name -> (module, whether it needs a GPU)
BENCHMARKS = {
    "kernels": ("pagedattn.bench.cli", False),
    "e2e": ("pagedattn.bench.e2e", False),
    "serve": ("pagedattn.bench.serve", False),
    "mla": ("pagedattn.bench.mla", False),
    "host": ("pagedattn.bench.host", False),
    "plot": ("pagedattn.bench.plot", False),
    "tune": ("pagedattn.bench.tune_decode", True),
    "waves": ("pagedattn.bench.waves", True),
}
# benchmarks that print their own interpreter banner and pass/fail columns
_OWN_BANNER = {"kernels", "host", "plot", "tune", "waves"}
_UNCHECKED = {"e2e", "serve"}  # engine runs: nothing is compared with a reference


def plain(text: str) -> str:
    """Help text without reStructuredText markup: ``x`` and :role:`x` become x."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return text.replace("``", "").replace("`", "")


def package_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("pagedattn")
    except metadata.PackageNotFoundError:  # a plain checkout on PYTHONPATH
        import pagedattn

        return pagedattn.__version__


def version_line() -> str:
    from importlib import metadata

    parts = []
    for dist in ("torch", "triton"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist} not installed")
    return f"pagedattn {package_version()} ({', '.join(parts)}, python {sys.version.split()[0]})"


def _run_bench(name: str, rest: list[str]) -> int:
    module_name, needs_gpu = BENCHMARKS[name]
    prog = f"pagedattn bench {name}"
    if needs_gpu and not any(a in ("-h", "--help") for a in rest) and not gpu_present():
        print(f"{prog} needs a GPU (CUDA or ROCm): it times CUDA-graph replays. No GPU is available here.",
              file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        print(f"{prog} is not available in this version of pagedattn ({module_name} is not installed).",
              file=sys.stderr)
        return 2
    if name not in _OWN_BANNER and not any(a in ("-h", "--help") for a in rest) and not gpu_present():
        interpreter_banner(checked=name not in _UNCHECKED)
    if hasattr(module, "add_arguments"):  # parser built here, options added by the module
        import argparse

        doc = plain((module.__doc__ or "").strip().splitlines()[0]) if module.__doc__ else None
        parser = argparse.ArgumentParser(prog=prog, description=doc)
        module.add_arguments(parser)
        return int(module.main(parser.parse_args(rest)) or 0)
    return int(module.main(rest) or 0)


def bench_main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(BENCH_USAGE)
        return 0
    if argv and argv[0] in BENCHMARKS:
        return _run_bench(argv[0], argv[1:])
    if argv and not argv[0].startswith("-"):
        print(f"pagedattn bench: unknown benchmark {argv[0]!r}\n\n{BENCH_USAGE}", file=sys.stderr)
        return 2
    return _run_bench("kernels", argv)


def main(argv=None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # output piped into head or less and closed: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(version_line())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "check":
        from pagedattn.check import main as check_main

        return check_main(rest)
    if command == "bench":
        return bench_main(rest)
    if command == "generate":
        from pagedattn.engine.cli import main as generate_main

        return generate_main(rest)
    print(f"pagedattn: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
