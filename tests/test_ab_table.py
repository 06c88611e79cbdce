"""scripts/ab_table.py: an A/B run's profile and bench reports as one table, a row per run and a column per round."""

from __future__ import annotations

import json

from scripts import ab_table

BENCH = {"warm": {"decode": {"tokens_per_s": 1225.7}, "prefill_512": {"tokens_per_s": 53889.1},
                  "prefill_16": {"tokens_per_s": 12618.3}, "system1_ms": {"p50": 1.588}}}  # fmt: skip


def test_rows_by_run_and_columns_by_round(tmp_path) -> None:
    (tmp_path / "fold").mkdir()
    for k, step in ((1, 1.316), (2, 1.3228)):
        profile = {"step_ms": step, "launches_per_step": 170}
        (tmp_path / "fold" / f"variant_profile_base_b1_{k}.json").write_text(json.dumps(profile))
    (tmp_path / "rope1_bench_2.json").write_text(json.dumps(BENCH))
    (tmp_path / "gemm_b1024_1.json").write_text(json.dumps({"error": "a batch of 1 to 512 ids, got 1024"}))
    (tmp_path / "cut_1.json").write_text('{"step_ms": 0.7')  # a run killed mid-write
    (tmp_path / "doctor.json").write_text("{}")  # no round: not a run's
    lines = ab_table.table(tmp_path).splitlines()
    assert lines[0] == "| run | round 1 | round 2 |" and lines[1] == "|---|---|---|"
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in lines[2:]}
    assert sorted(rows) == ["cut", "fold/variant_profile_base_b1", "gemm_b1024", "rope1_bench"]
    assert "step 1.316 ms, 170 launches | step 1.3228 ms, 170 launches |" in rows["fold/variant_profile_base_b1"]
    assert rows["rope1_bench"].endswith("|  | decode 1225.7, pp512 53889.1, pp16 12618.3 tok/s, system1 1.588 ms |")
    assert "error: a batch of 1 to 512 ids" in rows["gemm_b1024"]
    assert "unreadable: JSONDecodeError" in rows["cut"]
