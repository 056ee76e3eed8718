"""``python -m verl_ext.trust.signing`` run as an operator (and remote_samplers.sbatch) runs it: real
processes on real files. keygen -> pubkey -> enrol puts the key in the enrolment file; enrolling
the same key again changes nothing; bad input exits 2 naming it, without a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from verl_ext.trust.signing import Enrolment, SamplerKey

from tests.hetero.factories import build_group

ROOT = Path(__file__).resolve().parents[2]


def auth(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "verl_ext.trust.signing", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_keygen_pubkey_enrol_and_enrolling_again_changes_nothing(tmp_path):
    key_file, enrol_file = tmp_path / "sampler-7.key", tmp_path / "enrolment.json"
    made = auth("keygen", key_file, "sampler-7")
    assert made.returncode == 0, made.stderr
    public_hex = made.stdout.strip()
    for argv in (["pubkey", key_file], ["pubkey", key_file, "--sampler-id", "sampler-7"]):
        shown = auth(*argv)
        assert (shown.returncode, shown.stdout.strip()) == (0, public_hex), shown.stderr
    first = auth("enrol", enrol_file, "sampler-7", public_hex)
    assert first.returncode == 0, first.stderr
    text = enrol_file.read_text()
    enrolment = Enrolment.load(enrol_file)
    assert enrolment.keys == {"sampler-7": {first.stdout.strip(): public_hex}}
    record = build_group("r7-g0", 0, sampler="sampler-7").to_bytes()
    assert enrolment.open(SamplerKey.load(key_file).seal(record)) == ("sampler-7", record)
    again = auth("enrol", enrol_file, "sampler-7", auth("pubkey", key_file).stdout.strip())
    assert (again.returncode, again.stdout) == (0, first.stdout), again.stderr  # the same key id
    assert enrol_file.read_text() == text
    # a revoked sampler stays revoked when its key is enrolled again (what every sbatch start does)
    assert auth("revoke", enrol_file, "sampler-7").returncode == 0
    assert auth("enrol", enrol_file, "sampler-7", public_hex).returncode == 0
    assert Enrolment.load(enrol_file).revoked == {"sampler-7"}


def test_pubkey_refuses_another_samplers_key_and_what_is_no_key(tmp_path):
    key_file = tmp_path / "sampler-100.key"
    assert auth("keygen", key_file, "sampler-7").returncode == 0
    wrong = auth("pubkey", key_file, "--sampler-id", "sampler-100")
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert f"{key_file} is 'sampler-7''s key, not --sampler-id 'sampler-100''s" in wrong.stderr
    not_a_key = tmp_path / "notes.txt"
    not_a_key.write_text("hello\n")
    missing = tmp_path / "absent.key"
    for path in (not_a_key, missing):
        result = auth("pubkey", path)
        assert result.returncode == 2 and str(path) in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert "not a sampler key file" in auth("pubkey", not_a_key).stderr


def test_enrol_into_a_missing_directory_is_a_clear_error(tmp_path):
    enrol_file = tmp_path / "no" / "such" / "enrolment.json"
    public_hex = auth("keygen", tmp_path / "k.key", "sampler-1").stdout.strip()
    result = auth("enrol", enrol_file, "sampler-1", public_hex)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert str(enrol_file.parent) in result.stderr
