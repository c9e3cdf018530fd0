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


def test_a_model_directory_tokenizer_loads_as_auto_tokenizer_builds_it(tmp_path):
    """A directory whose tokenizer is the generic fast class over tokenizer.json is built directly
    (no second parse of tokenizer.json); one with added tokens in its config goes through
    AutoTokenizer. Either way: AutoTokenizer's ids, special tokens and chat template."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from tests.engine.tiny_models import save_tiny
    from tokenpath.engine.tokenizer import _generic_fast

    plain = save_tiny("qwen2", tmp_path / "plain", tie=True)
    assert _generic_fast(plain)
    objects = tmp_path / "objects"
    shutil.copytree(plain, objects)
    config = json.loads((objects / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {"0": {"content": "<|endoftext|>", "special": True}}
    (objects / "tokenizer_config.json").write_text(json.dumps(config))
    assert not _generic_fast(objects)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi wörld 🙂"}]
    for d in (plain, objects):
        ours, ref = Tokenizer(d), AutoTokenizer.from_pretrained(str(d))
        text = "Hello <|im_start|>user\n wörld 🙂"
        assert ours.encode(text) == ref.encode(text)
        assert (ours.eos_token_id, ours.bos_token_id, ours.vocab_size, ours.all_special_ids) == \
            (ref.eos_token_id, ref.bos_token_id, len(ref), set(ref.all_special_ids))
        assert ours.chat_template == ref.chat_template
        assert ours.apply_chat_template(messages) == ref.apply_chat_template(messages, add_generation_prompt=True,
                                                                             tokenize=True, return_dict=False)
