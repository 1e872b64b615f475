"""Circuit finding on circuits known in advance: a model wired by hand for induction (precision and recall
1.0), and the induction preset trained on repeats, whose previous-token -> induction edges the head
detectors name."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
import torch

from gptlab.inference.loading import load
from gptlab.inspection.attribution import attribute, certify
from gptlab.inspection.circuit import find_circuit, recovery
from gptlab.inspection.ground_truth import WIRED_CIRCUIT, induction_edges, repeat_pairs, wired_induction

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_wired_model_answers_by_induction() -> None:
    model = wired_induction()
    pairs = repeat_pairs(range(8), 6, span=6, seed=0)
    with torch.no_grad():
        for pair in pairs:
            logits = model(torch.tensor([list(pair.clean), list(pair.corrupt)]))[0][:, -1]  # (2, V)
            assert logits.argmax(-1).tolist() == [pair.target, pair.foil]
    assert induction_edges(model) == ["a0.h0->a1.h0.k"]  # what the detectors read off its heads
    assert set(induction_edges(model)) < set(WIRED_CIRCUIT)


@pytest.mark.parametrize("method", ["exact", "eap", "eap-ig", "eap-dest"])
def test_circuit_of_the_wired_model_is_its_known_circuit(method: str) -> None:
    model = wired_induction()
    pairs = repeat_pairs(range(8), 4, span=6, seed=1)
    circuit = find_circuit(model, pairs, attribute(model, pairs, method, steps=8), keep=0.8)
    assert recovery(circuit.names, WIRED_CIRCUIT) == (1.0, 1.0)
    assert circuit.faithfulness >= 0.99 and circuit.completeness >= 0.99
    assert circuit.curve[0] == pytest.approx(0.0, abs=1e-6)  # nothing kept: the corrupted run


def test_eap_ig_is_certified_on_the_wired_model_and_eap_is_saturated() -> None:
    model = wired_induction()
    pairs = repeat_pairs(range(8), 4, span=6, seed=2)
    exact, eap, ig = (attribute(model, pairs, m, steps=16) for m in ("exact", "eap", "eap-ig"))
    assert certify(ig, exact).spearman >= 0.9 and certify(ig, exact, 3).overlap == 1.0
    scores = dict(zip(eap.names, eap.scores.tolist(), strict=True))
    # the saturated softmax of the hand-set heads hides the key edge from the plain gradient
    assert abs(scores["a0.h0->a1.h0.k"]) < 1e-3 < abs(dict(exact.ranked())["a0.h0->a1.h0.k"])


def test_repeat_pairs_refuse_too_short_a_span() -> None:
    with pytest.raises(ValueError, match="span"):
        repeat_pairs(range(8), 1, span=4)
    with pytest.raises(ValueError, match="alphabet"):
        repeat_pairs(range(5), 1, span=6)


@pytest.fixture(scope="module")
def induction_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `induction` preset trained on `repeats` by gptlab's own loop (11 s on a quiet 2-core CPU)."""
    from gptlab.training.loop import train
    from gptlab.training.presets import resolve_configs

    run = tmp_path_factory.mktemp("induction") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        train(run, "repeats", *resolve_configs("induction"), progress=False)
    finally:
        torch.set_num_threads(threads)
    return run


@pytest.mark.slow
def test_trained_induction_circuit_holds_the_detected_edges(induction_run: Path) -> None:
    lm = load(induction_run)
    model, tokenizer = lm.model, lm.tokenizer
    known = induction_edges(model)
    assert known and all(name.startswith("a0.") and name.endswith(".k") for name in known)
    pairs = repeat_pairs(tokenizer.encode(string.ascii_letters), 16, span=16, seed=0)
    exact, ig, dest = (attribute(model, pairs, m, 16) for m in ("exact", "eap-ig", "eap-dest"))
    certificate = certify(ig, exact)  # EAP-IG: 0.79 to 0.95 over 27 models and pair sets (see the docs)
    assert certificate.spearman >= 0.85 and certificate.overlap >= 0.7, certificate
    certificate = certify(dest, exact)  # eap-dest: 0.92 to 0.98 over the same 27
    assert certificate.spearman >= 0.9 and certificate.overlap >= 0.7, certificate
    for ranking in (exact, ig, dest):
        circuit = find_circuit(model, pairs, ranking, keep=0.8)
        assert recovery(circuit.names, known)[1] == 1.0, (circuit.names, known)
        assert circuit.faithfulness >= 0.8
