"""The tokenizer built from a GGUF's metadata is cached in the data dir; a process that loses the
race to publish it (another engine process of `serve --replicas` published first) leaves no
temporary folder behind."""

from __future__ import annotations

import hashlib

from tokenpath.engine.loader import resolve_model_path
from tokenpath.engine.tokenizer import Tokenizer


def test_a_lost_publish_race_leaves_no_temporary_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENPATH_DATA_DIR", str(tmp_path))
    gguf = resolve_model_path("smollm2-135m-instruct")
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    taken = tmp_path / "tokenizers" / key
    taken.mkdir(parents=True)
    (taken / "being-written-by-another-process").write_text("")  # os.replace onto it fails
    tok = Tokenizer(gguf)
    assert tok.encode("Hello") and tok.decode(tok.encode("Hello")) == "Hello"
    assert sorted(p.name for p in (tmp_path / "tokenizers").iterdir()) == [key]
