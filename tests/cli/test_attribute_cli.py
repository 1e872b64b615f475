"""gptlab attribute and gptlab circuit on a run wired by hand for induction: --json is one object on stdout,
the certificate comes with the estimates, the known circuit is recovered, and mistakes are one line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gptlab.cli import main
from gptlab.inspection.ground_truth import WIRED_CIRCUIT, repeat_pairs, wired_induction
from gptlab.text.tokenizer import tokenizer_from_dict

pytestmark = pytest.mark.usefixtures("one_thread")

LETTERS = "abcdefgh"  # token i is LETTERS[i]


@pytest.fixture
def wired_run(tmp_path: Path, save_model: Callable[..., Path]) -> Path:
    tokenizer = tokenizer_from_dict({"kind": "char", "chars": LETTERS})
    return save_model(tmp_path / "wired", wired_induction(), tokenizer)


def text(ids: tuple[int, ...] | int) -> str:
    return "".join(LETTERS[i] for i in ([ids] if isinstance(ids, int) else ids))


def pairs_file(tmp_path: Path) -> Path:
    path = tmp_path / "pairs.jsonl"
    rows = [{"clean": text(p.clean), "corrupt": text(p.corrupt), "target": text(p.target),
             "foil": text(p.foil)} for p in repeat_pairs(range(8), 3, span=6, seed=4)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[dict[str, Any], str]:
    assert main(argv) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err  # one object, nothing else on stdout


def test_attribute_json_scores_every_edge_with_a_certificate(wired_run: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["attribute", str(wired_run), "--pairs", str(pairs_file(tmp_path)), "--json", "--steps", "8"]
    result, err = run_json(capsys, argv)
    assert result["method"] == "eap-ig" and result["pairs"] == 3 and result["steps"] == 8
    assert len(result["edges"]) == 6 + 6 * 3 + 5  # 2 q, 2 k, 2 v inputs a layer (from 1, then 3); logits
    assert result["metric"]["clean"] > 0 > result["metric"]["corrupt"]
    assert result["certificate"]["spearman"] >= 0.9 and result["certificate"]["overlap"] == 1.0
    assert "exact" in err and "eap-ig" in err  # progress on stderr
    exact, _ = run_json(capsys, ["attribute", str(wired_run), "--pairs", str(pairs_file(tmp_path)), "--json",
                                 "--method", "exact"])
    assert [e["name"] for e in exact["edges"]] == [e["name"] for e in result["edges"]]
    assert exact["certificate"] is None
    dest, err = run_json(capsys, argv + ["--method", "eap-dest"])
    assert dest["method"] == "eap-dest" and dest["steps"] == 0 and "eap-dest" in err
    assert dest["certificate"]["spearman"] >= 0.9 and dest["certificate"]["overlap"] == 1.0


def test_circuit_recovers_the_wired_circuit_and_draws_it(wired_run: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "circuit.png"
    known = ["--known", "embed->a0.h0.v", "--known", "a0.h0->a1.h0.k", "--known", "a1.h0->logits"]
    result, err = run_json(capsys, ["circuit", str(wired_run), "--pairs", str(pairs_file(tmp_path)), "--json",
                                    "--out", str(out), *known])
    assert {e["name"] for e in result["edges"]} == set(WIRED_CIRCUIT)
    assert result["precision"] == result["recall"] == 1.0
    assert result["faithfulness"] >= 0.99 and result["completeness"] >= 0.99
    assert out.read_bytes().startswith(b"\x89PNG") and f"wrote {out}" in err
    clean, corrupt = text((1, 2, 3, 4, 5, 1, 2)), text((1, 4, 3, 2, 5, 1, 2))
    assert main(["circuit", str(wired_run), "--clean", clean, "--corrupt", corrupt, "--target", "d",
                 "--method", "exact"]) == 0
    printed = capsys.readouterr().out
    assert "faithfulness 1.000" in printed and "a0.h0->a1.h0.k" in printed


@pytest.mark.parametrize(("argv", "words"), [
    (["--clean", "abcab", "--corrupt", "abcabc", "--target", "c"], "--clean is 5 tokens but --corrupt is 6"),
    (["--clean", "abcab", "--corrupt", "abdab", "--target", "cd"], "--target 'cd' is 2 tokens"),
    (["--clean", "abcab", "--corrupt", "abdab"], "give --clean, --corrupt and --target"),
    (["--clean", "abcab", "--corrupt", "abdab", "--target", "c", "--foil", "c"], "--foil is the same token"),
    (["--clean", "abcab", "--corrupt", "abdab", "--target", "c", "--method", "eap-ig", "--steps", "0"],
     "argument --steps: 0 is not"),
])
def test_mistakes_are_one_line(wired_run: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                               words: str) -> None:
    assert main(["attribute", str(wired_run), *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err


def test_bad_pairs_file_and_deep_exact_are_refused_in_one_line(wired_run: Path, tmp_path: Path,
                                                               random_gpt: Callable[..., Any],
                                                               save_model: Callable[..., Path],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"clean": "abcab", "corrupt": "abdab", "target": "c"}\n{"clean": "abc"}\n',
                   encoding="utf-8")
    assert main(["attribute", str(wired_run), "--pairs", str(bad)]) == 2
    assert "bad.jsonl line 2" in capsys.readouterr().err
    deep = save_model(tmp_path / "deep", random_gpt(0, n_layer=5, vocab_size=8),
                      tokenizer_from_dict({"kind": "char", "chars": LETTERS}))
    argv = ["attribute", str(deep), "--clean", "abcab", "--corrupt", "abdab", "--target", "c", "--method",
            "exact"]
    assert main(argv) == 2
    assert "name a subset with --edges" in capsys.readouterr().err
    assert main([*argv, "--edges", "a4.*->logits", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["edges"]) == 2
    assert main(["circuit", *argv[1:]]) == 2
    assert "a circuit needs every edge scored" in capsys.readouterr().err
