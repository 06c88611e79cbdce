"""scripts/ncu_stalls.py reads Nsight Compute's raw CSV page: the stall metrics by launch, medians by kernel, the
largest reasons first, and a clear failure on a report without them."""

from __future__ import annotations

import pytest

from scripts import ncu_stalls

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
HEAD = ["ID", "Kernel Name", STALL.format("long_scoreboard"), STALL.format("wait"), "gpu__time_duration.sum"]
REPORT = "\n".join(
    [
        "==PROF== Connected to process 1",
        '{"a": "line the profiled program printed"}',
        ",".join(f'"{h}"' for h in HEAD),
        '"","","","","us"',
        '"0","tcmv_q4_k_m16","1.97","0.85","9.9"',
        '"1","tcmv3_q4_k_m16","0.84","1,200.5","12.3"',
        '"2","tcmv_q4_k_m16","2.03","0.95","9.8"',
    ]
)


def test_reads_launches_and_medians(tmp_path) -> None:
    path = tmp_path / "ncu.csv"
    path.write_text(REPORT)
    reasons, launches = ncu_stalls.read(str(path))
    assert reasons == ["long_scoreboard", "wait"]
    assert [n for n, _ in launches] == ["tcmv_q4_k_m16", "tcmv3_q4_k_m16", "tcmv_q4_k_m16"]
    assert launches[1][1]["wait"] == 1200.5  # thousands separators dropped
    rows = ncu_stalls.by_kernel(launches)
    assert [n for n, _ in rows] == ["tcmv_q4_k_m16", "tcmv3_q4_k_m16"]
    assert rows[0][1] == pytest.approx({"long_scoreboard": 2.0, "wait": 0.9})
    text = ncu_stalls.table(rows, top=1).splitlines()
    assert text[2] == "| tcmv_q4_k_m16 | 2.90 | long_scoreboard 2.00 |"
    assert text[3] == "| tcmv3_q4_k_m16 | 1201.34 | wait 1200.50 |"


def test_a_report_without_stalls_fails_clearly(tmp_path) -> None:
    path = tmp_path / "ncu.csv"
    path.write_text('"ID","Kernel Name","gpu__time_duration.sum"\n"","","us"\n"0","k","1.0"\n')
    with pytest.raises(ValueError, match="no stall metrics"):
        ncu_stalls.read(str(path))
    path.write_text("==PROF== no kernels were profiled\n")
    with pytest.raises(ValueError, match="no raw-page CSV header"):
        ncu_stalls.read(str(path))
