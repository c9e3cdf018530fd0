"""A test server's data dir as a user's second start finds it: holding the tokenizers that the
first start built from the GGUF models it serves.

Building a tokenizer from GGUF metadata takes seconds (tens on 2 busy cores, in every engine
process of `--replicas` at once), and each test server gets a data dir of its own, so without
this every server start in the suite would build them again. They are built once, in this
process's own data dir (the engine's cache: tokenizer.gguf_tokenizer_cache), and copied in.

The first-start path stays tested where it is the subject: the build, its cache's 0700 folders
and its publish race (tests/engine/test_tokenizer_cache.py, tests/api/test_small_safety.py), and
every server started with `fresh_data_dir=True` or by a test's own launcher.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

CHAT_MODEL = "smollm2-135m-instruct"  # what `tokenpath serve` runs without --model


def served_models(args: Sequence[str]) -> list[str]:
    """The --model values of a `serve` command line (the default chat model when none)."""
    models = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--model"]
    models += [a.split("=", 1)[1] for a in args if a.startswith("--model=")]
    return models or [CHAT_MODEL]


def seed_tokenizers(data_dir: Path, models: Sequence[str]) -> None:
    """Copy into `data_dir`/tokenizers the tokenizers built from those of `models` that are GGUF
    files (known names included), building them here first when this process has none. A data
    dir that does not exist yet is made 0700, as the server makes it."""
    from tokenpath.engine.loader import resolve_model_path
    from tokenpath.engine.tokenizer import Tokenizer, gguf_tokenizer_cache
    from tokenpath.errors import ModelLoadError

    for name in models:
        try:
            source = resolve_model_path(name)
        except ModelLoadError:
            continue  # a bad name: the server's own error is what the test reads
        if not source.is_file():
            continue  # a model directory: its tokenizer files are read as they are
        built = gguf_tokenizer_cache(source)
        if not (built / "tokenizer.json").is_file():
            try:
                Tokenizer(source)  # builds and saves it there
            except ModelLoadError:
                continue  # a broken file: the server's own error is what the test reads
        if not data_dir.exists():
            data_dir.mkdir(parents=True, mode=0o700)
        target = data_dir / "tokenizers" / built.name
        if not target.exists():
            target.parent.mkdir(exist_ok=True, mode=0o700)
            shutil.copytree(built, target)
