"""The `dgpp` command line, for real: in-process through `cli.main(argv)` and through the installed
console script, against a tiny random-weight checkpoint with the real SmolLM2 tokenizer.

Every test runs with a private DGPP_HOME and HF cache and with the hub offline. Sampling defaults
to greedy (`--temperature 0`), so the same prompt always gives the same text.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from dgpp.appliance import cli
from dgpp.appliance.common.exit_codes import EXIT_CONFIG, EXIT_ERROR, EXIT_USAGE
from tests.conftest import build_tiny_checkpoint

RunCli = Callable[..., tuple[int, str, str]]
DGPP = Path(sys.executable).parent / "dgpp"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), tokenizer_dir, "LlamaForCausalLM")


@pytest.fixture(autouse=True)
def private_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private DGPP_HOME and HF cache, with the hub offline."""
    monkeypatch.setenv("DGPP_HOME", str(tmp_path / "dgpp"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> RunCli:
    """Run `cli.main(argv)` in-process with `stdin` as standard input; return (rc, out, err)."""

    def run(*argv: str, stdin: str = "") -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        capsys.readouterr()
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def run_console_script(*argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    assert DGPP.is_file(), f"the dgpp console script is not installed next to {sys.executable}"
    return subprocess.run(
        [str(DGPP), *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )


def generate_args(checkpoint: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(checkpoint), "--max-tokens", "5", *extra]


def chat_args(checkpoint: Path) -> list[str]:
    return ["chat", "--model", str(checkpoint), "--max-tokens", "5"]


# --- generate ----------------------------------------------------------------------------------


def test_generate_prints_a_completion(run_cli: RunCli, checkpoint: Path) -> None:
    code, out, err = run_cli(*generate_args(checkpoint, "hello"))
    assert code == 0, err
    assert out.endswith("\n")
    assert out.strip()
    assert "Traceback" not in err


def test_generate_is_greedy_by_default_and_repeatable(run_cli: RunCli, checkpoint: Path) -> None:
    first = run_cli(*generate_args(checkpoint, "hello"))
    second = run_cli(*generate_args(checkpoint, "hello"))
    other = run_cli(*generate_args(checkpoint, "a", "different", "prompt"))
    assert first[0] == second[0] == other[0] == 0
    assert first[1] == second[1]
    assert other[1] != first[1]


def test_generate_reads_the_prompt_from_stdin(run_cli: RunCli, checkpoint: Path) -> None:
    code, from_argv, err = run_cli(*generate_args(checkpoint, "hello", "world"))
    assert code == 0, err
    code, from_stdin, err = run_cli(*generate_args(checkpoint), stdin="hello world")
    assert code == 0, err
    assert from_stdin.strip()
    assert from_stdin == from_argv  # argv words are joined by spaces into the same prompt


def test_generate_with_chat_template(run_cli: RunCli, checkpoint: Path) -> None:
    code, templated, err = run_cli(*generate_args(checkpoint, "--chat-template", "hello"))
    assert code == 0, err
    assert templated.strip()
    code, plain, _ = run_cli(*generate_args(checkpoint, "hello"))
    assert code == 0
    assert templated != plain  # the prompt was wrapped as a chat turn


def test_generate_empty_stdin_is_an_error(run_cli: RunCli, checkpoint: Path) -> None:
    code, out, err = run_cli(*generate_args(checkpoint), stdin="")
    assert code == EXIT_ERROR
    assert out == ""
    assert err.startswith("dgpp: error:") and "empty" in err


# --- chat --------------------------------------------------------------------------------------


def test_chat_replies_to_piped_lines_and_resets(run_cli: RunCli, checkpoint: Path) -> None:
    code, reply_hi, _ = run_cli(*generate_args(checkpoint, "--chat-template", "hi"))
    assert code == 0
    code, reply_again, _ = run_cli(*generate_args(checkpoint, "--chat-template", "again"))
    assert code == 0
    code, out, err = run_cli(*chat_args(checkpoint), stdin="hi\n/reset\nagain\n/exit\nnever\n")
    assert code == 0, err
    # One reply per user line; after /reset the conversation is just "again", so each reply is
    # exactly what a single-turn chat prompt gives. Nothing after /exit is answered.
    assert out == reply_hi + reply_again
    assert "you>" not in out  # piped input gets no interactive prompts


def test_chat_keeps_the_conversation_without_reset(run_cli: RunCli, checkpoint: Path) -> None:
    code, with_reset, _ = run_cli(*chat_args(checkpoint), stdin="hi\n/reset\nhi\n")
    assert code == 0
    code, without_reset, err = run_cli(*chat_args(checkpoint), stdin="\nhi\n\nhi\n")
    assert code == 0, err  # blank lines are skipped, end of input leaves
    reply = with_reset[: len(with_reset) // 2]
    assert with_reset == reply * 2  # after /reset "hi" is answered as the first time
    assert without_reset.startswith(reply)
    assert without_reset != with_reset  # the second "hi" saw the first exchange


def test_chat_with_a_system_message(run_cli: RunCli, checkpoint: Path) -> None:
    code, plain, _ = run_cli(*chat_args(checkpoint), stdin="hi\n")
    code2, with_system, err = run_cli(
        *chat_args(checkpoint), "--system", "You answer in French.", stdin="hi\n"
    )
    assert code == code2 == 0, err
    assert with_system.strip() and with_system != plain


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "problem"),
    [
        ("no-such-org/no-such-model", "dgpp model pull no-such-org/no-such-model"),
        ("./no/such/dir", "no such checkpoint directory"),
        ("default", "dgpp model install-default"),
        ("not a repo id!", "not 'default', a local directory or a Hugging Face repo id"),
    ],
)
def test_unknown_model_reference_is_an_error(
    run_cli: RunCli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str, problem: str
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli("generate", "--model", model, "--max-tokens", "5", "hello")
    assert code == EXIT_CONFIG
    assert out == ""
    assert err.startswith("dgpp: error:")
    assert problem in err
    assert len(err.strip().splitlines()) == 1


def test_a_file_is_not_a_checkpoint(run_cli: RunCli, checkpoint: Path) -> None:
    code, _, err = run_cli("generate", "--model", str(checkpoint / "config.json"), "hello")
    assert code == EXIT_CONFIG
    assert err.startswith("dgpp: error:") and "is a file" in err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--block-size", "0", "block_size must be a positive integer, got 0"),
        ("--kv-capacity", "-4", "kv_capacity must be a positive integer, got -4"),
        ("--max-concurrency", "0", "max_concurrency must be a positive integer"),
        ("--prefill-chunk-tokens", "0", "prefill_chunk_tokens must be a positive integer"),
        ("--max-model-len", "0", "max_model_len must be a positive integer, got 0"),
        ("--max-model-len", "100000", "max_model_len=100000 exceeds"),
        ("--threads", "0", "num_threads must be a positive integer, got 0"),
        ("--max-tokens", "0", "max_tokens must be at least 1"),
        ("--max-tokens", "100000", "exceeds this model's context"),
        ("--temperature", "-1", "temperature must be in [0, 100]"),
        ("--top-p", "0", "top_p must be in (0, 1]"),
    ],
)
def test_invalid_flag_value_is_a_clear_error(
    run_cli: RunCli, checkpoint: Path, flag: str, value: str, message: str
) -> None:
    code, out, err = run_cli("generate", "--model", str(checkpoint), flag, value, "hello")
    # Engine knobs are configuration (exit 3); a bad sampling request is an input error (1).
    sampling = flag in ("--max-tokens", "--temperature", "--top-p")
    assert code == (EXIT_ERROR if sampling else EXIT_CONFIG)
    assert out == ""
    assert err.startswith("dgpp: error:")
    assert message in err


def test_invalid_flag_value_in_chat_is_a_clear_error(run_cli: RunCli, checkpoint: Path) -> None:
    code, _, err = run_cli(
        "chat", "--model", str(checkpoint), "--block-size", "0", stdin="hi\n/exit\n"
    )
    assert code == EXIT_CONFIG
    assert err.startswith("dgpp: error:") and "block_size" in err


def test_invalid_device_is_a_clear_error(run_cli: RunCli, checkpoint: Path) -> None:
    code, _, err = run_cli("generate", "--model", str(checkpoint), "--device", "bogus", "hello")
    assert code == EXIT_CONFIG
    assert err.startswith("dgpp: error:") and "device" in err


def test_unparsable_flag_value_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], checkpoint: Path
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--model", str(checkpoint), "--block-size", "abc", "hello"])
    assert info.value.code == EXIT_USAGE
    assert "invalid int value: 'abc'" in capsys.readouterr().err


def test_missing_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == EXIT_USAGE
    assert "usage: dgpp" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"dgpp {version('dgpp')}"


# --- model -------------------------------------------------------------------------------------


def test_model_list_empty_gives_the_install_hint(run_cli: RunCli) -> None:
    code, out, err = run_cli("model", "list")
    assert code == 0, err
    assert out == "no models installed; run `dgpp model install-default`\n"


def test_model_list_shows_installed_checkpoints(run_cli: RunCli, private_env: Path) -> None:
    model = private_env / "dgpp" / "models" / "mine"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "model.safetensors").write_bytes(b"\0" * (3 * 2**20))
    (private_env / "dgpp" / "models" / "not-a-checkpoint").mkdir()
    code, out, err = run_cli("model", "list")
    assert code == 0, err
    assert out.splitlines() == [f"mine\tLlamaForCausalLM\tnone\t3 MiB\t{model}"]


def test_model_pull_offline_is_an_error(run_cli: RunCli) -> None:
    code, out, err = run_cli("model", "pull", "some-org/some-model")
    assert code == EXIT_CONFIG
    assert out == ""
    assert err == (
        "dgpp: error: cannot download some-org/some-model: HF_HUB_OFFLINE is set and it is not "
        "in the cache\n"
    )


def test_model_pull_invalid_repo_id_is_an_error(run_cli: RunCli) -> None:
    code, _, err = run_cli("model", "pull", "not a repo id!")
    assert code == EXIT_CONFIG
    assert err.startswith("dgpp: error:") and "is not a valid repo id" in err


# --- the in-process streams --------------------------------------------------------------


def test_in_process_output_follows_the_current_streams(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outputs = []
    for _ in range(2):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            assert cli.main(generate_args(checkpoint, "hello")) == 0
        outputs.append(buffer.getvalue())
    assert outputs[0].strip() and outputs[0] == outputs[1]
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n/exit\n"))
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert cli.main(chat_args(checkpoint)) == 0
    assert buffer.getvalue().strip()


# --- the installed console script --------------------------------------------------------------


def test_console_script_generate_and_chat(run_cli: RunCli, checkpoint: Path) -> None:
    _, expected, _ = run_cli(*generate_args(checkpoint, "--chat-template", "hi"))
    result = run_console_script(*generate_args(checkpoint, "--chat-template", "hi"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected
    result = run_console_script(*chat_args(checkpoint), stdin="hi\n/exit\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected


def test_console_script_error_has_no_traceback(tmp_path: Path) -> None:
    result = run_console_script("generate", "--model", str(tmp_path / "missing"), "hello")
    assert result.returncode == EXIT_CONFIG
    assert result.stdout == ""
    assert result.stderr == f"dgpp: error: no such checkpoint directory: {tmp_path / 'missing'}\n"


def test_console_script_model_pull_offline_has_no_traceback() -> None:
    result = run_console_script("model", "pull", "some-org/some-model")
    assert result.returncode == EXIT_CONFIG
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("dgpp: error: cannot download some-org/some-model")
