"""`dgpp eval perplexity` and `dgpp eval kld` (issue 44): a text scored in windows through the
engine's prefill equals transformers' log-softmax on the same windows; a reference run saved
and compared with itself gives zero divergence, another precision a positive one; the coarse
KL equals the full KL when the reference keeps every token; and every bad input is refused by
name (an empty, binary or non-UTF-8 file, a reference of another tokenizer or text or windows,
a file that is no reference, a window longer than one request may score, --top-k out of range).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from dgpp.appliance.cli import main
from dgpp.appliance.common.exit_codes import EXIT_CONFIG, EXIT_OK
from dgpp.engine.evaluation.eval_scoring import coarse_kl, windows
from tests.conftest import build_tiny_checkpoint

TEXT = (
    "The fox ran across the field at dawn, and the farmer's dog followed it to the river. "
    "There the fox stopped, turned, and looked back at the dog, which sat down in the grass. "
    "Neither moved until the sun was high; then both went home, each by its own path.\n"
)
ENGINE = ["--block-size", "4", "--prefill-chunk-tokens", "7", "--kv-capacity", "512"]
WINDOWS = ["--context", "24", "--stride", "10"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("eval")
    return build_tiny_checkpoint(out, tokenizer_dir, "Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("eval-text") / "fox.txt"
    path.write_text(TEXT)
    return path


def _eval(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict, str]:
    code = main(["eval", *args])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == EXIT_OK else {}, err


@pytest.mark.parametrize(("n", "context", "stride"), [(2, 2, 1), (60, 24, 10), (30, 50, 25)])
def test_windows_score_every_token_once(n: int, context: int, stride: int) -> None:
    spans = windows(n, context, stride)
    scored = [t for span in spans for t in range(span.first, span.end)]
    assert scored == list(range(1, n))
    for span in spans:
        assert span.end - span.begin <= context and span.first > span.begin
        if span.begin > 0:  # a later window's tokens all have its overlap before them
            assert span.first - span.begin >= context - stride


def _transformers_nll(checkpoint: Path, tokens: list[int], context: int, stride: int) -> list:
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    nll = [math.nan] * (len(tokens) - 1)
    for span in windows(len(tokens), context, stride):
        ids = tokens[span.begin : span.end]
        with torch.inference_mode():
            logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
        for t in range(span.first, span.end):
            nll[t - 1] = -logprobs[t - span.begin - 1, tokens[t]].item()
    return nll


def test_perplexity_equals_transformers(
    checkpoint: Path, text: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, result, err = _eval(
        capsys, "perplexity", str(text), "--model", str(checkpoint), *ENGINE, *WINDOWS, "--json"
    )
    assert code == EXIT_OK, err
    tokens = AutoTokenizer.from_pretrained(str(checkpoint))(TEXT).input_ids
    nll = _transformers_nll(checkpoint, tokens, 24, 10)
    assert result["tokens"] == len(tokens) - 1 and len(tokens) > 50
    assert abs(result["nll"] - sum(nll) / len(nll)) < 1e-5
    assert result["ppl_low"] < result["ppl"] < result["ppl_high"]
    assert abs(math.log(result["ppl"]) - result["nll"]) < 1e-9
    assert "scored" in err  # the progress


def test_kld_against_itself_and_another_precision(
    checkpoint: Path, text: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = tmp_path / "ref.safetensors"
    common = [str(text), "--model", str(checkpoint), *ENGINE, "--json"]
    code, saved, err = _eval(capsys, "kld", *common, *WINDOWS, "--save-reference", str(reference))
    assert code == EXIT_OK, err
    with safe_open(str(reference), framework="pt") as handle:
        assert handle.get_tensor("top_ids").shape == (saved["tokens"], 32)
    code, same, err = _eval(capsys, "kld", *common, "--reference", str(reference))
    assert code == EXIT_OK, err  # the windows come from the reference
    assert same["context"] == 24 and same["stride"] == 10
    assert abs(same["kl_mean"]) < 1e-6 and same["kl_max"] < 1e-5 and same["same_top"] == 1.0
    assert same["delta_ppl"] == 0.0 and same["rms_delta_p"] == 0.0
    # A prompt is prefilled, never drafted: speculative decoding on scores the same.
    code, drafting, err = _eval(
        capsys, "kld", *common, "--reference", str(reference), "--spec", "ngram"
    )
    assert code == EXIT_OK, err
    assert drafting["kl_max"] < 1e-5 and drafting["delta_ppl"] == 0.0
    code, other, err = _eval(
        capsys, "kld", *common, "--reference", str(reference), "--dtype", "bfloat16"
    )
    assert code == EXIT_OK, err
    assert other["kl_mean"] > 1e-9 and other["kl_mean"] > 2 * other["kl_se"]  # near-uniform
    assert other["kl_percentiles"]["50"] <= other["kl_percentiles"]["99"] <= other["kl_max"]
    assert other["ppl_reference"] == saved["ppl"] and other["delta_ppl"] != 0.0
    assert 0 < other["rms_delta_p"] < 0.01 and 0.5 < other["same_top"] <= 1.0


def test_coarse_kl_is_the_full_kl_with_every_token_and_below_it_with_fewer() -> None:
    torch.manual_seed(0)
    p = (torch.randn(5, 50) * 2).log_softmax(-1)
    q = (torch.randn(5, 50) * 2).log_softmax(-1)
    full = (p.exp() * (p - q)).sum(-1)
    order = p.argsort(dim=-1, descending=True)
    every = coarse_kl(p.gather(1, order), q.gather(1, order))
    assert torch.allclose(every, full, atol=1e-5)
    some = coarse_kl(p.gather(1, order[:, :8]), q.gather(1, order[:, :8]))
    assert bool((some <= full + 1e-6).all()) and bool((some > 0).all())
    assert torch.equal(coarse_kl(p[:, :8], p[:, :8]), torch.zeros(5))


def _refused(capsys: pytest.CaptureFixture[str], args: list[str], words: str) -> None:
    code, _, err = _eval(capsys, *args)
    assert code == EXIT_CONFIG, err
    assert words in err, err


def test_bad_inputs_are_refused_by_name(
    checkpoint: Path, text: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = ["--model", str(checkpoint), *ENGINE]
    files = {
        "empty.txt": b" \n",
        "binary.bin": b"abc\x00\x01\x02def",
        "latin1.txt": "caf\u00e9 au lait".encode("latin-1"),
        "one.txt": b"a",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    _refused(capsys, ["perplexity", str(tmp_path / "empty.txt"), *model], "is empty")
    _refused(capsys, ["perplexity", str(tmp_path / "binary.bin"), *model], "binary file")
    _refused(capsys, ["perplexity", str(tmp_path / "latin1.txt"), *model], "not UTF-8")
    _refused(capsys, ["perplexity", str(tmp_path / "one.txt"), *model], "scoring needs 2")
    _refused(capsys, ["perplexity", str(tmp_path / "missing.txt"), *model], "cannot read")
    too_long = ["--context", "600", "--max-scored-prompt-tokens", "100"]
    _refused(capsys, ["perplexity", str(text), *model, *too_long], "one request may score")
    _refused(
        capsys, ["perplexity", str(text), *model, "--context", "24", "--stride", "24"], "--stride"
    )
    ref = tmp_path / "ref.safetensors"
    _refused(
        capsys, ["kld", str(text), *model, "--save-reference", str(ref), "--top-k", "0"], "--top-k"
    )
    saving = ["kld", str(text), *model, *WINDOWS, "--json", "--save-reference", str(ref)]
    code, _, err = _eval(capsys, *saving)
    assert code == EXIT_OK, err
    against = ["kld", str(text), *model, "--reference"]
    _refused(capsys, [*against, str(text)], "not a dgpp eval reference")
    _refused(capsys, [*against, str(tmp_path / "none")], "no reference file")
    _refused(capsys, [*against, str(ref), "--context", "30"], "same --context and --stride")
    other_text = tmp_path / "other.txt"
    other_text.write_text(TEXT.upper())
    _refused(capsys, ["kld", str(other_text), *model, "--reference", str(ref)], "another text")
    with safe_open(str(ref), framework="pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    foreign = tmp_path / "foreign.safetensors"
    save_file(tensors, str(foreign), metadata={**metadata, "tokenizer": "0" * 64})
    _refused(capsys, [*against, str(foreign)], "another tokenizer")


def test_a_deployment_file_sets_the_model_and_knobs(
    checkpoint: Path, text: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The deployment's model and engine knobs are the ones evaluated; flags override them."""
    engine = {"kv_capacity": 512, "block_size": 4, "dtype": "bfloat16"}
    deployment = tmp_path / "site.json"
    deployment.write_text(json.dumps({"model": str(checkpoint), "engine": engine}))
    common = ["perplexity", str(text), *WINDOWS, "--json"]
    code, filed, err = _eval(capsys, *common, "--deployment", str(deployment))
    assert code == EXIT_OK, err
    flags = ["--model", str(checkpoint), *ENGINE]
    _, bf16, _ = _eval(capsys, *common, *flags, "--dtype", "bfloat16")
    _, fp32, _ = _eval(capsys, *common, *flags)
    assert filed["model"] == str(checkpoint)
    assert abs(filed["nll"] - bf16["nll"]) < 1e-3 and filed["nll"] != fp32["nll"]
    code, over, err = _eval(capsys, *common, "--deployment", str(deployment), "--dtype", "float32")
    assert code == EXIT_OK, err
    assert abs(over["nll"] - fp32["nll"]) < 1e-5
