"""The qualification script's benchmark rows and gates, exercised by its CPU dry-run path.

``scripts/bench/cuda_qualify.py bench --device cpu`` is what ``DEVICE_CHECK_DRY=1``
runs: here at a tiny shape, with Liger and Cut Cross-Entropy absent (their
rows are skipped with the reason), the new rows (CCE, achieved TFLOP/s, the
loss features against Liger) must be present and computed; the verdict's
gates (ours vs the fastest peer, memory vs torch-native) must decide a
device run and stay out of a CPU one.
"""

from __future__ import annotations

import json

from scripts.bench import cuda_qualify


def test_dry_run_bench_has_the_peer_feature_and_tflops_rows(tmp_path):
    argv = [
        "bench",
        "--out",
        str(tmp_path),
        "--device",
        "cpu",
        "--shape",
        "24x8x40",
        "--chunks",
        "4",
        "16",
        "--repeats",
        "1",
    ]
    assert cuda_qualify.main(argv) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    (shape,) = doc["shapes"]
    rows = {r["method"]: r for r in shape["rows"]}
    assert {"cce", "ours[chunk=4]", "ours[chunk=16]", "ours_capture"} <= set(rows)
    for name in cuda_qualify.FEATURES:
        assert rows[f"ours[{name}]"]["status"] == "ok", name
        assert rows[f"ours[{name}]"]["tflops"] > 0, name
        assert rows[f"liger[{name}]"]["status"] == "skipped"
        assert "CUDA" in rows[f"liger[{name}]"]["note"]
        assert f"ours / liger time [{name}]" in shape["ratios"]
    assert rows["cce"]["status"] == "skipped"
    assert "CUDA" in rows["cce"]["note"]
    # Both chunk-math paths are rows; the CPU dry run does not compile.
    assert rows["ours[chunk_math=eager]"]["status"] == "ok"
    assert rows["ours[chunk_math=compiled]"]["status"] == "skipped"
    assert "compiled / eager chunk math time" in shape["ratios"]
    assert rows["ours"]["tflops"] == 6 * 24 * 8 * 40 / (rows["ours"]["ms"] / 1e3) / 1e12
    assert isinstance(shape["gates_failed"], list)
    md = (tmp_path / "bench.md").read_text()
    assert "TFLOP/s (6NHV)" in md
    assert "| ours[softcap=30] |" in md
    assert "gates: " in md


def _bench_doc(device: str, rows: list[dict]) -> dict:
    by = {r["method"]: r for r in rows}
    shape = {
        "shape": {"N": 8, "H": 4, "V": 16},
        "rows": rows,
        "ratios": {},
        "gates_failed": cuda_qualify.gates(by),
    }
    return {"env": {"device": device}, "dtype": "bfloat16", "repeats": 1, "shapes": [shape]}


def test_gates_fail_a_device_run_only(tmp_path):
    slow = [
        {"method": "torch_native", "ms": 10.0, "extra_peak_bytes": 100},
        {"method": "liger", "ms": 8.0, "extra_peak_bytes": 50},
        {"method": "ours", "ms": 9.0, "extra_peak_bytes": 120},
        {"method": "ours[softcap=30]", "ms": 12.0},
        {"method": "liger[softcap=30]", "ms": 10.0},
    ]
    failed = cuda_qualify.gates({r["method"]: r for r in slow})
    assert failed == [
        "ours 9.00 ms > 1.10 x liger 8.00 ms",
        "ours extra peak 0 MiB > torch_native 0 MiB",
        "ours[softcap=30] 12.00 ms > 1.10 x liger[softcap=30] 10.00 ms",
    ]
    fine = [
        {"method": "torch_native", "ms": 10.0, "extra_peak_bytes": 100},
        {"method": "cce", "ms": 8.0},
        {"method": "ours", "ms": 8.8, "extra_peak_bytes": 100},
    ]
    assert cuda_qualify.gates({r["method"]: r for r in fine}) == []
    for device, expect in (("cuda:0", True), ("cpu", False)):
        out = tmp_path / device.replace(":", "_")
        out.mkdir()
        (out / "bench.json").write_text(json.dumps(_bench_doc(device, slow)))
        reasons = cuda_qualify.verdict(out)["reasons"]
        gated = [r for r in reasons if r.startswith("bench gate")]
        assert bool(gated) == expect, (device, reasons)
        if expect:
            assert gated[0] == "bench gate N=8 H=4 V=16: ours 9.00 ms > 1.10 x liger 8.00 ms"
