"""poptorch.ctc_beam_search_decoder, eager and compiled, against a prefix beam search written
here (a dictionary of prefixes in float64), the exact CTC probabilities of every labelling (a
beam wide enough keeps them all), greedy decoding of near-certain frames, and PopTorch's errors."""

import itertools
import math
import re
from collections import defaultdict

import pytest
import torch

import ipu_backend as poptorch

NEG_INF = -math.inf
RTOL, ATOL = 1e-5, 1e-6


def logadd(a: float, b: float) -> float:
    if a == NEG_INF:
        return b
    if b == NEG_INF:
        return a
    top = max(a, b)
    return top + math.log(math.exp(a - top) + math.exp(b - top))


def reference_decode(log_probs, length, blank, beam_width):
    """[(log probability, labels)] of the beams after ``length`` frames, best first: each beam
    keeps the log probabilities of its frames ending in a blank and in a label."""
    beams = {(): (0.0, NEG_INF)}
    for frame in log_probs[:length]:
        grown = defaultdict(lambda: [NEG_INF, NEG_INF])
        for prefix, (ends_blank, ends_label) in beams.items():
            either = logadd(ends_blank, ends_label)
            for c, p in enumerate(frame):
                if c == blank:
                    grown[prefix][0] = logadd(grown[prefix][0], either + p)
                elif prefix and prefix[-1] == c:
                    grown[prefix][1] = logadd(grown[prefix][1], ends_label + p)            # "a" + "a"
                    grown[prefix + (c,)][1] = logadd(grown[prefix + (c,)][1], ends_blank + p)  # "a-" + "a"
                else:
                    grown[prefix + (c,)][1] = logadd(grown[prefix + (c,)][1], either + p)
        ranked = sorted(grown.items(), key=lambda item: -logadd(*item[1]))
        beams = {prefix: value for prefix, value in ranked[:beam_width] if logadd(*value) > NEG_INF}
    return sorted(((logadd(*value), prefix) for prefix, value in beams.items()), key=lambda item: -item[0])


def reference_outputs(log_probs, lengths, blank, beam_width, top_paths):
    input_length, batch_size, _ = log_probs.shape
    probs = torch.full((batch_size, top_paths), NEG_INF)
    path_lengths = torch.zeros(batch_size, top_paths, dtype=torch.int32)
    paths = torch.zeros(batch_size, top_paths, input_length, dtype=torch.int32)
    for b in range(batch_size):
        frames = log_probs[:, b].double().tolist()
        beams = reference_decode(frames, int(lengths[b]), blank, beam_width)
        for k, (p, labels) in enumerate(beams[:top_paths]):
            probs[b, k], path_lengths[b, k] = p, len(labels)
            paths[b, k, :len(labels)] = torch.tensor(labels)
    return probs, path_lengths, paths


class Decoder(torch.nn.Module):
    def __init__(self, **settings):
        super().__init__()
        self.settings = settings

    def forward(self, log_probs, lengths):
        return poptorch.ctc_beam_search_decoder(log_probs, lengths, **self.settings)


def assert_decoded(actual, expected, what):
    probs, lengths, paths = actual
    assert lengths.dtype == paths.dtype == torch.int32, what
    torch.testing.assert_close(paths, expected[2], rtol=0, atol=0, msg=f"{what}: paths")
    torch.testing.assert_close(lengths, expected[1], rtol=0, atol=0, msg=f"{what}: lengths")
    torch.testing.assert_close(probs, expected[0], rtol=RTOL, atol=ATOL, msg=f"{what}: probabilities")


@pytest.mark.parametrize("blank,beam_width,top_paths",
                         [(0, 1, 1), (0, 3, 3), (4, 10, 3), (2, 10, 1), (5, 3, 1)])
def test_eager_and_compiled_equal_the_reference(blank, beam_width, top_paths):
    torch.manual_seed(beam_width * 10 + blank)
    log_probs = (2 * torch.randn(8, 4, 6)).log_softmax(-1)
    lengths = torch.tensor([8, 5, 1, 0])
    expected = reference_outputs(log_probs, lengths, blank, beam_width, top_paths)
    model = Decoder(blank=blank, beam_width=beam_width, top_paths=top_paths)
    assert_decoded(model(log_probs, lengths), expected, "eager")
    assert_decoded(poptorch.inferenceModel(model)(log_probs, lengths), expected, "compiled")


def test_poptorch_s_own_case_with_default_settings():
    """PopTorch's test: unnormalised log probabilities, int32 lengths, beam width 100."""
    torch.manual_seed(42)
    log_probs = torch.randn(9, 3, 10)
    lengths = torch.randint(5, 9, (3,), dtype=torch.int)
    expected = reference_outputs(log_probs, lengths, 0, 100, 1)
    assert_decoded(Decoder()(log_probs, lengths), expected, "eager")
    result = poptorch.inferenceModel(Decoder())(log_probs, lengths)
    assert [tuple(r.shape) for r in result] == [(3, 1), (3, 1), (3, 1, 9)]
    assert_decoded(result, expected, "compiled")


def exact_labelling_probabilities(frames, blank):
    """log P(labelling) for every labelling: the sum over the alignments that collapse to it."""
    totals = defaultdict(lambda: NEG_INF)
    for alignment in itertools.product(range(len(frames[0])), repeat=len(frames)):
        labels = tuple(c for i, c in enumerate(alignment) if c != blank and (i == 0 or alignment[i - 1] != c))
        totals[labels] = logadd(totals[labels], sum(frame[c] for frame, c in zip(frames, alignment)))
    return totals


def test_a_beam_holding_every_labelling_gives_the_exact_ctc_probabilities():
    torch.manual_seed(3)
    log_probs = torch.randn(5, 2, 3).log_softmax(-1)
    lengths = torch.tensor([5, 4])
    top_paths = 4
    expected = (torch.empty(2, top_paths), torch.empty(2, top_paths, dtype=torch.int32),
                torch.zeros(2, top_paths, 5, dtype=torch.int32))
    for b in range(2):
        frames = log_probs[:int(lengths[b]), b].double().tolist()
        best = sorted(exact_labelling_probabilities(frames, 1).items(), key=lambda item: -item[1])
        for k, (labels, p) in enumerate(best[:top_paths]):
            expected[0][b, k], expected[1][b, k] = p, len(labels)
            expected[2][b, k, :len(labels)] = torch.tensor(labels, dtype=torch.int32)
    model = Decoder(blank=1, beam_width=64, top_paths=top_paths)      # 63 labellings of 5 frames
    assert_decoded(model(log_probs, lengths), expected, "eager")
    assert_decoded(poptorch.inferenceModel(model)(log_probs, lengths), expected, "compiled")


def test_one_beam_over_near_certain_frames_is_greedy_decoding():
    """With one beam the decoder is not greedy decoding in general (a prefix sums its alignments),
    but it is when each frame is nearly certain: the best alignment, repeats merged, blanks dropped."""
    torch.manual_seed(5)
    best = torch.randint(0, 4, (12, 3))
    best[3:5, 0] = 2                                         # a repeat to merge
    best[6:9, 1] = torch.tensor([3, 0, 3])                   # a blank between repeats keeps both
    log_probs = (10 * torch.nn.functional.one_hot(best, 4) + 0.1 * torch.randn(12, 3, 4)).log_softmax(-1)
    lengths = torch.tensor([12, 10, 7])
    greedy = []
    for b in range(3):
        frames = best[:int(lengths[b]), b].tolist()
        greedy.append([c for i, c in enumerate(frames) if c != 0 and (i == 0 or frames[i - 1] != c)])
    model = Decoder(blank=0, beam_width=1)
    compiled = poptorch.inferenceModel(model)
    for what, (_, path_lengths, paths) in (("eager", model(log_probs, lengths)),
                                               ("compiled", compiled(log_probs, lengths))):
        for b in range(3):
            assert paths[b, 0, :path_lengths[b, 0]].tolist() == greedy[b], what
            assert not paths[b, 0, path_lengths[b, 0]:].any(), what


def test_lengths_beyond_the_input_are_clamped():
    torch.manual_seed(7)
    log_probs = torch.randn(6, 2, 4).log_softmax(-1)
    model = Decoder(beam_width=4, top_paths=2)
    expected = model(log_probs, torch.tensor([6, 0]))
    assert_decoded(model(log_probs, torch.tensor([9, -2])), expected, "eager")
    assert_decoded(poptorch.inferenceModel(model)(log_probs, torch.tensor([9, -2])), expected, "compiled")


PROBS, LENGTHS = torch.zeros(3, 2, 4), torch.ones(2, dtype=torch.int)


@pytest.mark.parametrize("args,message", [
    ((PROBS.tolist(), LENGTHS),
     "ctc_beam_search_decoder: probs must be a torch.tensor argument. <class 'list'> is not supported."),
    ((PROBS, [3, 3]),
     "ctc_beam_search_decoder: lengths must be a torch.tensor argument. <class 'list'> is not supported."),
    ((PROBS[0], LENGTHS), "Incorrect shape for first input to CTC beam search decoder"),
    ((PROBS.int(), LENGTHS), "floating point log probabilities"),
    ((PROBS, LENGTHS.float()), "lengths must be an integer tensor of shape [batch_size]"),
    ((PROBS, torch.ones(3, dtype=torch.int)), "lengths must be an integer tensor of shape [batch_size]"),
    ((PROBS, LENGTHS, 4), "blank must be an int between 0 and 3, got 4"),
    ((PROBS, LENGTHS, 0, 0), "beam_width must be an int at least 1, got 0"),
    ((PROBS, LENGTHS, 0, 2, 3), "top_paths must be an int between 1 and 2, got 3"),
])
def test_argument_errors(args, message):
    with pytest.raises(poptorch.Error, match=re.escape(message)):
        poptorch.ctc_beam_search_decoder(*args)


class DecodingTrainer(torch.nn.Module):
    def __init__(self, loss_from_paths):
        super().__init__()
        self.linear = torch.nn.Linear(4, 5)
        self.loss_from_paths = loss_from_paths

    def forward(self, x, lengths):
        log_probs = self.linear(x).log_softmax(-1)
        probs, path_lengths, paths = poptorch.ctc_beam_search_decoder(log_probs, lengths, beam_width=3)
        loss = -probs.mean() if self.loss_from_paths else log_probs.exp().pow(2).mean()
        return paths, poptorch.identity_loss(loss, "none")


def test_decoding_trains_beside_a_loss_but_has_no_gradient_of_its_own():
    torch.manual_seed(11)
    x, lengths = torch.randn(6, 2, 4), torch.tensor([6, 3])
    model = DecodingTrainer(loss_from_paths=False)
    expected = model(x, lengths)[0]
    trainer = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    torch.testing.assert_close(trainer(x, lengths)[0], expected, rtol=0, atol=0)
    model = DecodingTrainer(loss_from_paths=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        model(x, lengths)[1].backward()
    trainer = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match="ctc_beam_search_decoder has no gradient"):
        trainer(x, lengths)
