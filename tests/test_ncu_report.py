"""scripts/ncu_report.py's summary of Nsight Compute exports (the profiling itself needs a GPU)."""

import csv
import pathlib

import pytest

from tests.scripts_support import load_script

STALLS = ("barrier", "wait", "long_sb")


@pytest.fixture(scope="module")
def report():
    return load_script("ncu_report")


def _write_exports(prefix: pathlib.Path, sass_rows):
    details = [("Duration", "ms", "1.16"), ("Issue Slots Busy", "%", "51.24"), ("Registers Per Thread", "", "168"),
               ("Duration", "ms", "9.99")]  # a second kernel's row: the first one counts
    with open(f"{prefix}.details.csv", "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit", "Metric Value"])
        for name, unit, value in details:
            w.writerow(["0", "k", "s", name, unit, value])
    with open(f"{prefix}.sass.csv", "w", newline="") as f:
        f.write('"Kernel Name","k",\n')
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
                   + [f"stall_{s}" for s in STALLS] + [f"stall_{s} (Not Issued)" for s in STALLS])
        for source, executed, stalls in sass_rows:
            w.writerow(["0x0", source, str(sum(stalls)), f"{executed:,}"] + [str(s) for s in stalls]
                       + ["0"] * len(STALLS))


def test_opcode_drops_predicate_and_modifiers(report):
    assert report.opcode("      @!P1  HGMMA.64x64x16.F32.BF16 R88, R148, gdesc[UR16], RZ") == "HGMMA"
    assert report.opcode("@UP2 UTMALDG.4D [UR24], [UR32]") == "UTMALDG"
    assert report.opcode("FMNMX R5, R108, R5, !PT") == "FMNMX"


def test_summary_counts_opcodes_stalls_and_hot_blocks(report, tmp_path):
    rows = [("LDC R1, c[0x0][0x28]", 100, (1, 0, 0)),  # prologue: executed rarely
            ("FFMA R1, R2, R3, R4", 5000, (0, 30, 0)),  # a loop body of three, 5000 times each
            ("@!P1 BRA 0x100", 5000, (0, 0, 50)),
            ("MUFU.EX2 R5, R5", 5000, (20, 10, 0)),
            ("FFMA R6, R6, R7, R8", 7000, (0, 0, 0))]  # another block
    _write_exports(tmp_path / "k", rows)
    s = report.summarize({"k": str(tmp_path / "k")}, min_share=0.05)["k"]
    assert s["metrics"]["Duration"] == ("1.16", "ms") and s["metrics"]["Registers Per Thread"][0] == "168"
    assert s["instructions"] == 100 + 3 * 5000 + 7000
    assert s["by_opcode"]["FFMA"]["instructions"] == 12000
    assert s["by_opcode"]["FFMA"]["sample_share"] == pytest.approx(30 / 111, abs=1e-4)
    assert s["stalls"]["long_sb"] == pytest.approx(50 / 111, abs=1e-4)
    loop, tail = s["hot_blocks"]  # the prologue's 0.5% is under min_share
    assert loop["rows"] == [1, 3] and loop["length"] == 3 and loop["times"] == 5000
    assert loop["opcodes"] == {"FFMA": 1, "BRA": 1, "MUFU": 1}
    assert loop["instruction_share"] == pytest.approx(15000 / 22100, abs=1e-4)
    assert loop["stalls"]["long_sb"] == pytest.approx(50 / 110, abs=1e-4)
    assert tail["rows"] == [4, 4] and tail["sample_share"] == 0
