"""Model URIs: the grammar, errors that name the field, cache keys, and what serving downloads."""

from __future__ import annotations

import pytest

from kvserve.runtime.sources import uri


@pytest.mark.parametrize(
    "text,revision,expect",
    [
        ("hf://meta-llama/Meta-Llama-3-8B", None, ("hf", "meta-llama/Meta-Llama-3-8B", "", "main")),
        ("hf://org/name@v1.0", None, ("hf", "org/name", "", "v1.0")),
        ("hf://org/name", "refs/pr/1", ("hf", "org/name", "", "refs/pr/1")),
        ("hf://org/name@abc", "abc", ("hf", "org/name", "", "abc")),
        ("s3://bucket/models/llama/", None, ("s3", "bucket", "models/llama", None)),
        ("s3://my.bucket", None, ("s3", "my.bucket", "", None)),
        ("pvc://models/llama3", None, ("pvc", "models", "llama3", None)),
        ("file:///models/x/", None, ("file", "", "/models/x", None)),
    ],
)
def test_parse(text, revision, expect):
    got = uri.parse(text, revision)
    assert (got.scheme, got.location, got.path, got.revision) == expect


@pytest.mark.parametrize(
    "text,revision,field,words",
    [
        ("gs://bucket/m", None, "spec.model.uri", "no supported scheme"),
        ("hf://org/name/extra", None, "spec.model.uri", "exactly two path parts"),
        ("hf://org--x/name", None, "spec.model.uri", "ORG/NAME"),
        ("hf://org/name@a", "b", "spec.model.revision", "contradicts"),
        ("s3://B/x", None, "spec.model.uri", "bucket"),
        ("s3://bucket/a//b", None, "spec.model.uri", "empty"),
        ("s3://bucket/m", "main", "spec.model.revision", "hf:// sources only"),
        ("file://relative", None, "spec.model.uri", "ABSOLUTE"),
    ],
)
def test_bad_uris_name_the_field(text, revision, field, words):
    with pytest.raises(uri.SourceError) as info:
        uri.parse(text, revision)
    assert info.value.field == field and words in str(info.value) and str(info.value).startswith(field)


def test_cache_key_is_per_source_and_revision_and_readable():
    a = uri.cache_key(uri.parse("hf://org/name@main"))
    assert a == uri.cache_key(uri.parse("hf://org/name"))  # main is the default revision: the same folder
    assert a.startswith("org--name--main-") and len(a.rsplit("-", 1)[1]) == 16
    others = {
        uri.cache_key(uri.parse(u))
        for u in ("hf://org/name@v2", "hf://org/name2", "s3://org/name", "s3://org/name/sub")
    }
    assert a not in others and len(others) == 4
    assert "/" not in uri.cache_key(uri.parse("s3://bkt/deep/prefix/x"))


def test_only_serving_files_at_the_top_level_are_wanted():
    assert all(
        uri.wanted(p)
        for p in (
            "config.json",
            "model-00001-of-00004.safetensors",
            "tokenizer.json",
            "model.safetensors.index.json",
            "generation_config.json",
        )
    )
    assert not any(
        uri.wanted(p)
        for p in (
            "README.md",
            "pytorch_model.bin",
            "original/consolidated.safetensors",
            "onnx/model.safetensors",
            ".gitattributes",
        )
    )
    assert uri.missing_required(["config.json", "tokenizer.json"]) == ["*.safetensors"]
    assert uri.missing_required(["config.json", "model.safetensors"]) == []


def test_download_refuses_mounted_sources_with_the_reason(tmp_path, capsys):
    from kvserve.cli.main import main

    log = tmp_path / "log"
    assert main(["download", "pvc://models/llama3", "--dest", str(tmp_path / "m"), "--termination-log", str(log)]) == 1
    assert "mounted, not fetched" in log.read_text() and "mounted, not fetched" in capsys.readouterr().err
    assert (
        main(
            [
                "download",
                "hf://org/name@a",
                "--revision",
                "b",
                "--dest",
                str(tmp_path / "m"),
                "--termination-log",
                str(log),
            ]
        )
        == 1
    )
    assert log.read_text().startswith("kvserve: download failed: --revision: 'b' contradicts")
