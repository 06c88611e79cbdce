"""scripts/ncu_table.py reads Nsight Compute's text report: launches in order, the metrics it names, medians by
kernel, and a clear failure on a file with no launches."""

from __future__ import annotations

from scripts import ncu_table

REPORT = """==PROF== Connected to process 1234
  matvec3_q4_k_n1 (640, 1, 1)x(256, 1, 1), Context 1, Stream 13, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    DRAM Throughput                   %         8.07
    Duration                         us        15.46
    Elapsed Cycles                cycle       22,880
    Compute (SM) Throughput           %        35.38
    Section: Scheduler Statistics
    Issued Warp Per Scheduler                        0.54
    Section: Launch Statistics
    Registers Per Thread             register/thread              64
    Section: Occupancy
    Achieved Occupancy                        %        42.12
  attn_decode (4, 32, 1)x(128, 1, 1), Context 1, Stream 13, Device 0, CC 9.0
    Duration                         us        11.62
    Compute (SM) Throughput           %         8.37
  matvec3_q4_k_n1 (640, 1, 1)x(256, 1, 1), Context 1, Stream 13, Device 0, CC 9.0
    Duration                         us        17.46
    Duration                         us        99.00
    Registers Per Thread             register/thread              64
"""


def test_launches_in_order_with_their_metrics():
    launches = ncu_table.parse(REPORT.splitlines())
    assert [(x.kernel, x.grid, x.block) for x in launches] == [
        ("matvec3_q4_k_n1", (640, 1, 1), (256, 1, 1)),
        ("attn_decode", (4, 32, 1), (128, 1, 1)),
        ("matvec3_q4_k_n1", (640, 1, 1), (256, 1, 1)),
    ]
    first = launches[0].metrics
    assert first == {"DRAM Throughput": 8.07, "Duration": 15.46, "Compute (SM) Throughput": 35.38,
                     "Issued Warp Per Scheduler": 0.54, "Registers Per Thread": 64.0,
                     "Achieved Occupancy": 42.12}  # fmt: skip
    assert launches[2].metrics["Duration"] == 17.46  # a name's first value


def test_rows_a_launch_or_a_kernel():
    launches = ncu_table.parse(REPORT.splitlines())
    rows = ncu_table.table(launches).splitlines()
    assert len(rows) == 2 + 3
    assert rows[3].startswith("| attn_decode | 4 x 32 | 11.62 | 8.37 | - |")
    by_kernel = ncu_table.table(launches, by_kernel=True).splitlines()
    assert len(by_kernel) == 2 + 2
    assert by_kernel[2].startswith("| matvec3_q4_k_n1 | 640 | 16.46 | 35.38 |")  # median of 15.46 and 17.46
    assert by_kernel[2].endswith("| 64 | 2 |")


def test_a_file_without_launches_fails_clearly(tmp_path, capsys):
    path = tmp_path / "empty.txt"
    path.write_text("==PROF== nothing profiled\n")
    assert ncu_table.main([str(path)]) == 1
    assert "no kernel launches found" in capsys.readouterr().err
