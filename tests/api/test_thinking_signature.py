"""The thinking-signature key (api/anthropic/signature.py): kept in the data dir so signatures
outlive a restart, made once even when two servers start together; a configured key wins."""

from __future__ import annotations

import stat
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from tokenpath.api.anthropic import signature


def test_data_dir_key_is_made_once_private_and_reused(tmp_path):
    # Many rounds of 8 racing callers: the old create-then-write let one read the file empty in
    # about 1 round in 40 on 2 cores (a failure of make test under load).
    for i in range(200):
        with ThreadPoolExecutor(8) as pool:
            raced = list(pool.map(lambda _, d=tmp_path / f"race{i}": signature.key_file_key(d), range(8)))
        assert len(set(raced)) == 1 and len(raced[0]) == 32, f"round {i}: {len(set(raced))} keys"
        assert sorted(p.name for p in (tmp_path / f"race{i}").iterdir()) == [signature.KEY_FILE]
    with ThreadPoolExecutor(8) as pool:
        keys = list(pool.map(lambda _: signature.key_file_key(tmp_path / "data"), range(8)))
    assert len(set(keys)) == 1 and len(keys[0]) == 32
    path = tmp_path / "data" / signature.KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # a "restart": the same key, so the blocks it signed still verify
    config = SimpleNamespace(data_dir=str(tmp_path / "data"), thinking_signing_key=None)
    sig = signature.sign(keys[0], "the sky is blue")
    assert signature.verify(signature.signing_key(config), "the sky is blue", sig)
    assert not signature.verify(keys[0], "the sky is green", sig)
    assert not signature.verify(keys[0], "the sky is blue", None)


def test_configured_key_wins_over_the_data_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("TOKENPATH_THINKING_SIGNING_KEY", raising=False)
    config = SimpleNamespace(data_dir=str(tmp_path), thinking_signing_key="shared-secret")
    assert signature.signing_key(config) == b"shared-secret"
    assert not (tmp_path / signature.KEY_FILE).exists()
    monkeypatch.setenv("TOKENPATH_THINKING_SIGNING_KEY", "from-env")
    assert signature.signing_key(SimpleNamespace(data_dir=str(tmp_path))) == b"from-env"


def test_unwritable_data_dir_falls_back_to_a_process_key(tmp_path, monkeypatch):
    """A data dir the server cannot write (a read-only mount): a key for the process, not a 500."""
    monkeypatch.delenv("TOKENPATH_THINKING_SIGNING_KEY", raising=False)
    blocker = tmp_path / "file"
    blocker.write_text("")  # (a data dir under a file: cannot be made, as root too)
    key = signature.signing_key(SimpleNamespace(data_dir=str(blocker / "data"), thinking_signing_key=None))
    assert len(key) == 32
