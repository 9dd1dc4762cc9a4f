"""benchmarks/sweep_linear_scan_backward.py on CPU: every (block, warps) of every case is checked and
timed, the default shape's gradients are its own, and the module's entry is restored."""
import json
import pathlib
import sys

from mamba_annotated.scan import blocked

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import sweep_linear_scan_backward as sweep  # noqa: E402


def test_sweep_covers_every_case_and_restores_the_launch_shape(tmp_path, monkeypatch):
    default = blocked.BACKWARD
    out = tmp_path / "sweep.json"
    monkeypatch.setattr(sys, "argv", ["sweep", "--json", str(out)])
    sweep.main()
    assert blocked.BACKWARD == default
    result = json.loads(out.read_text())
    cases = {(r["dtype"], r["T"], r["block"], r["warps"]) for r in result["rows"]}
    assert len(cases) == len(result["rows"]) == len(sweep.DTYPES) * len(sweep.LENGTHS) * len(sweep.CONFIGS)
    for r in result["rows"]:
        assert r["ms"] > 0 and r["rel_diff"] < 1e-5
        assert r["default"] == ((r["block"], r["warps"]) == tuple(default))
        if r["default"]:
            assert r["rel_diff"] == 0
