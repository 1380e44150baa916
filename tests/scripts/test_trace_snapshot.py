"""scripts/trace_snapshot.py: two snapshots of the same checkout compare identical (addresses and repository
roots normalized); a changed record, or a file in one snapshot only, makes ``compare`` fail and says which."""

import json
import sys

from paths import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

import trace_snapshot  # noqa: E402


def test_snapshots_of_one_checkout_agree_and_a_changed_record_is_named(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert trace_snapshot.main(["write", str(a), "--families", "none"]) == 0
    assert trace_snapshot.main(["write", str(b), "--families", "none"]) == 0
    names = sorted(p.name for p in a.iterdir())
    assert "mlp_train_hdt.log" in names and "encoder_forward_left_on.jsonl" in names and "ops_hdt.log" in names
    meta = json.loads((b / trace_snapshot.META).read_text())
    meta["root"] = "/elsewhere/checkout"  # another checkout: its paths normalize the same
    (b / trace_snapshot.META).write_text(json.dumps(meta))
    capsys.readouterr()
    assert trace_snapshot.main(["compare", str(a), str(b)]) == 0
    assert "identical" in capsys.readouterr().out

    trace = b / "mlp_train_hashmode.jsonl"
    lines = trace.read_text().splitlines()
    record = json.loads(lines[5])
    record["hash"] = "0" * 16
    lines[5] = json.dumps(record)
    trace.write_text("\n".join(lines) + "\n")
    (b / "ops_hdt.log").unlink()
    assert trace_snapshot.main(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "differs: mlp_train_hashmode.jsonl" in out and "ops_hdt.log" in out and "only in" in out
