"""Bad input to the ``kvstride`` command is one line on stderr naming the option and a valid
form, and exit status 2, before any work starts (nothing is replayed, no store is started)."""

from __future__ import annotations

import json

import pytest

from kvstride import cli

BAD = [
    (["simulate", "--store", "redis"], "--store", "mooncake://HOST:PORT"),
    (["simulate", "--batch", "0"], "--batch", ">= 1"),
    (["simulate", "--conversations=-3"], "--conversations", ">= 1"),
    (["simulate", "--conversations", "0"], "--conversations", ">= 1"),
    (["simulate", "--store-bytes=-1"], "--store-bytes", "512MiB"),
    (["simulate", "--store-bytes", "64 lots"], "--store-bytes", "512MiB"),
    (["simulate", "--store-bytes", "0"], "--store-bytes 0", "> 0"),
    (["simulate", "--fault-every=-1"], "--fault-every", ">= 0"),
    (["simulate", "--plot", "/nope/x.png"], "--plot", "does not exist"),
    (["simulate", "--plot", "x.txt"], "--plot", ".png"),
    (["simulate", "--trace", "t.jsonl", "--capacity=-1G"], "--capacity", "256G"),
    (["simulate", "--trace", "t.jsonl", "--capacity", "0"], "--capacity", "256G"),
    (["simulate", "--trace", "t.jsonl", "--limit", "-5"], "--limit", ">= 1"),
    (["simulate", "--trace", "t.jsonl", "--checkpoints", "foo"], "--checkpoints", "every:T"),
    (["simulate", "--trace", "t.jsonl", "--policy", "lru"], "--policy", "kvstride"),
    (["explain", "--dcp", "0"], "--dcp", ">= 1"),
    (["explain", "--groups", ""], "--groups", "full_attention:16"),
    (["simulate", "--groups", "  "], "--groups", "full_attention:16"),
    (["store", "serve", "--bytes", "-600"], "--bytes", "512MiB"),
    (["store", "serve", "--bytes", "1G", "--config-out", "/nope/dir/x.json"], "--config-out", "does not exist"),
    (["store", "serve", "--bytes", "1G", "--host", "nohost.invalid"], "--host", "address"),
    (["store", "serve", "--bytes", "1G", "--secret-file", "/nope/kvstride/deploy.key"], "--secret-file", "mkdir -p"),
    (["store", "serve", "--bytes", "100000T"], "--bytes", "memory"),
]


def assert_one_line_and_exit_2(capsys, argv, option: str, fix: str) -> None:
    """``kvstride argv`` exits 2 with one line on stderr naming ``option`` and ``fix``, nothing
    on stdout."""
    try:
        code = cli.main(argv)
    except SystemExit as done:
        code = done.code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1, captured.err
    assert option in lines[0] and fix in lines[0], lines[0]
    assert captured.out == ""


@pytest.mark.parametrize("argv, option, fix", BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, option, fix):
    assert_one_line_and_exit_2(capsys, argv, option, fix)


def _trace(tmp_path, rows) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("rows, why", [
    ([], "no requests"),
    ([{"input_length": -5, "hash_ids": [1]}], "input_length -5"),
    ([{"input_length": 512, "hash_ids": []}], "hash_ids"),
])
def test_a_trace_without_requests_is_refused(tmp_path, capsys, rows, why):
    assert cli.main(["simulate", "--trace", _trace(tmp_path, rows), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and why in err


def test_trace_mode_writes_no_file_unasked(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trace = _trace(tmp_path, [{"input_length": 1024, "hash_ids": [1, 2]}, {"input_length": 1024, "hash_ids": [1, 2]}])
    assert cli.main(["simulate", "--trace", trace, "--capacity", "1G,2G", "--quiet"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.jsonl"]
    assert cli.main(["simulate", "--trace", trace, "--capacity", "1G,2G", "--json"]) == 0
    document = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["capacity_bytes"] for r in document["results"]] == [1 << 30, 2 << 30]


def test_model_means_the_models_geometry_everywhere(capsys):
    """``--model`` in explain and simulate is the model's geometry, as with --trace; the key
    namespace is --namespace."""
    assert cli.main(["explain", "--model", "qwen3-next-80b", "--namespace", "prod"]) == 0
    out = capsys.readouterr().out
    assert "full_attention:544,mamba:544" in out and "prod" in out
    for argv in (["explain", "--model", "gemma-3-27b", "--preset", "llama"],
                 ["simulate", "--trace", "t.jsonl", "--preset", "gemma3"]):
        with pytest.raises(SystemExit) as done:
            cli.main(argv)
        assert done.value.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, named", [
    (["simulate", "--capacity", "1G"], "--capacity"),
    (["simulate", "--policy", "dense", "--decode-states"], "--policy, --decode-states"),
    (["simulate", "--trace", "t.jsonl", "--store", "mooncake", "--batch", "2"], "--store, --batch"),
    (["simulate", "--seed", "abc"], "--seed"),
])
def test_an_option_the_mode_ignores_is_refused(capsys, argv, named):
    try:
        code = cli.main(argv)
    except SystemExit as done:
        code = done.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and named in err[0], err


def test_every_option_says_what_it_does_in_plain_text():
    """``--help`` of every command: each option has a help text, none shows reStructuredText."""
    import argparse

    def options(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, subparser in action.choices.items():
                    yield from options(subparser, f"{name} {sub}")
            elif action.dest != "help":
                yield name, action

    parser = cli.build_parser()
    missing = [(name, action.option_strings) for name, action in options(parser, "kvstride") if not action.help]
    assert missing == []
    assert "``" not in parser.format_help()


def test_output_cut_short_by_its_reader_ends_quietly():
    """``kvstride explain ... | head -1``: the reader closes the pipe; the command ends with
    SIGPIPE's status and no traceback."""
    import subprocess
    import sys

    # The reader is gone before the command writes its first line (it takes a second to start).
    command = f"{sys.executable} -m kvstride.cli explain --preset glm-ring | true"
    run = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in run.stderr and "BrokenPipeError" not in run.stderr, run.stderr
    assert run.returncode == 141


def test_bench_skips_what_it_cannot_run_naming_the_install(capsys, monkeypatch):
    """After ``make simulate`` (the demo's packages alone) ``kvstride bench`` runs what it can:
    a bench whose module is missing is skipped in one line naming the install, not a traceback
    and a failed exit."""
    monkeypatch.setattr(cli, "BENCHES", (("keypath.py", ["--repeat", "1"], ("cbor2_not_installed",)),
                                         ("store.py", ["--reps", "1"], ("mooncake.store",))))
    monkeypatch.setattr(cli, "INSTALLS", dict(cli.INSTALLS, cbor2_not_installed="pip install cbor2"))
    monkeypatch.setattr(cli, "_importable", lambda module: False)
    assert cli.main(["bench", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "skipped: needs cbor2_not_installed, which is not installed: pip install cbor2" in out
    assert "skipped: needs mooncake.store, which is not installed: pip install mooncake-transfer-engine-non-cuda" in out


def _transfer(extra: dict, policy: str = "recompute") -> str:
    """A ``--kv-transfer-config`` as the README writes it."""
    return json.dumps({"kv_connector": "KVStrideConnector", "kv_connector_module_path": "kvstride.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": policy, "kv_connector_extra_config": extra})


#: Mistakes ``kvstride check-config`` finds offline, each with what its one line names.
BAD_CONFIGS = [
    (_transfer({"secret_fle": "/etc/kvstride/deploy.key"}), "secret_fle", "did you mean 'secret_file'"),
    (_transfer({}, policy="fail"), "kv_load_failure_policy='fail'", '"recompute"'),
    (_transfer({"store": "redis"}), "redis", "'embedded'"),
    (_transfer({"store": "mooncake", "disk_path": "/tmp"}), "disk_path", "store 'embedded'"),
    (_transfer({"disk_bytes": "4TiB"}), "disk_bytes", "disk_path"),
    (_transfer({"store_bytes": "lots"}), "store_bytes", "'512MiB'"),
    (_transfer({"load_timeout_s": -1}), "load_timeout_s", "seconds"),
    (_transfer({"trust_client_mm_uuids": "yes"}), "trust_client_mm_uuids", "true or false"),
    (_transfer({"admission": "lru"}), "admission", "kvstride, dense"),
    (_transfer({"disk_path": "/nope/kvstride", "disk_bytes": "1G"}), "disk_path", "mkdir -p"),
    (_transfer({"secret_file": "/nope/kvstride/deploy.key"}), "/nope/kvstride/deploy.key", "store serve --secret-file"),
    (_transfer({}).replace("KVStrideConnector", "KVStride"), "kv_connector", "KVStrideConnector"),
    ("{bad", "not JSON", "single quotes"),
]


@pytest.mark.parametrize("config, option, fix", BAD_CONFIGS, ids=[option for _, option, _ in BAD_CONFIGS])
def test_check_config_names_each_mistake_in_one_line(capsys, monkeypatch, config, option, fix):
    """``kvstride check-config`` runs the connector's checks that need no engine, offline: a
    mistake is the connector's own error, one line, exit 2."""
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    assert_one_line_and_exit_2(capsys, ["check-config", config], option, fix)


def test_check_config_accepts_the_readme_lines_and_reads_the_model(capsys, tmp_path):
    """Every embedded-store ``--kv-transfer-config`` line of the README and docs/OPERATING.md passes (a disk tier's
    folder where it exists); with ``--model`` the lookup alignment of the model's groups is
    printed."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    documents = "".join((root / name).read_text() for name in ("README.md", "docs/OPERATING.md"))
    lines = [json.loads(m) for m in re.findall(r"--kv-transfer-config '(\{.*?\})'", documents)]
    embedded = [t for t in lines if t["kv_connector_extra_config"].get("store", "embedded") == "embedded"]
    assert embedded
    for transfer in embedded:
        extra = transfer["kv_connector_extra_config"]
        if "disk_path" in extra:
            extra["disk_path"] = str(tmp_path)
        assert cli.main(["check-config", json.dumps(transfer)]) == 0
    assert cli.main(["check-config", _transfer({}), "--model", "qwen3-next-80b"]) == 0
    assert "hits are whole multiples of 544 tokens" in capsys.readouterr().out


def test_every_size_reads_one_grammar():
    """The connector's sizes, ``store serve --bytes`` and the command's size options read the
    same forms alike: binary units, whatever the spelling."""
    from kvstride.cli import _capacities, _disk_size, _size
    from kvstride.sizes import parse_size

    for text in ("256G", "256GB", "256GiB", "256 gib", "0.25T"):
        assert parse_size(text) == _capacities(text)[0] == _disk_size(text) == _size(text) == 256 << 30
    assert parse_size("1P") == 1 << 50 and parse_size(4096) == 4096
