"""``poptorch.ctc_beam_search_decoder`` as a torch custom op: CTC prefix beam search over log
probabilities ``[input_length, batch, classes]``, as Poplibs' ``popnn::ctc_infer``.

What it computes, for each batch element, over its first ``lengths[b]`` time steps (clamped to
``[0, input_length]``): beams are label sequences (prefixes) with two log probabilities, of the
frames so far ending in a blank and ending in a label. Each step a beam is kept (a blank, or its
last label repeated) or extended by any label but the blank (a label equal to its last one
extends it only from the frames ending in a blank); candidates with equal prefixes are summed,
and the ``beam_width`` most probable survive (on equal probabilities, the earlier beam first and,
within a beam, the lower class; a kept beam counts as the blank class). The results are the
``top_paths`` best beams: the log probability of the prefix (blank and label endings summed),
its length, and its labels padded with zeros to ``input_length``. A path of probability zero (no
such beam: ``beam_width`` or the inputs allow fewer) is reported as log probability ``-inf``,
length 0. Repeated labels are not merged beyond CTC's own rule (TensorFlow's
``merge_repeated=False``, as Poplibs is validated against).

The eager kernel below is that definition over a dictionary of prefixes; the lowering
(``compiler/lowerings/ctc_decoding.py``) computes the same with arrays of static shape.
"""

import numpy as np
import torch

LENGTH_DTYPE = torch.int32
"""The dtype of the path lengths and labels (Poplar's unsigned int, as torch's int32)."""


def _ranked_beams(log_probs: np.ndarray, steps: int, blank: int, beam_width: int) -> list:
    """``[(prefix, log_pb, log_pnb)]``, best first, after ``steps`` time steps."""
    num_classes = log_probs.shape[1]
    beams = [((), 0.0, -np.inf)]
    for t in range(steps):
        y = log_probs[t]
        candidates: dict = {}          # prefix -> [log_pb, log_pnb, rank key]
        for w, (prefix, pb, pnb) in enumerate(beams):
            total = np.logaddexp(pb, pnb)
            last = prefix[-1] if prefix else None
            kept = candidates.setdefault(prefix, [-np.inf, -np.inf, 0])
            kept[0] = np.logaddexp(kept[0], total + y[blank])
            if last is not None:
                kept[1] = np.logaddexp(kept[1], pnb + y[last])
            kept[2] = w * num_classes + blank
            for c in range(num_classes):
                if c == blank:
                    continue
                extended = candidates.setdefault(prefix + (c,), [-np.inf, -np.inf, w * num_classes + c])
                extended[1] = np.logaddexp(extended[1], (pb if c == last else total) + y[c])
        live = [(np.logaddexp(pb, pnb), key, prefix, pb, pnb)
                for prefix, (pb, pnb, key) in candidates.items() if np.logaddexp(pb, pnb) > -np.inf]
        live.sort(key=lambda item: (-item[0], item[1]))
        beams = [(prefix, pb, pnb) for _, _, prefix, pb, pnb in live[:beam_width]]
    return beams


@torch.library.custom_op("ipu_backend::ctc_beam_search_decoder", mutates_args=())
def ctc_beam_search_decoder(probs: torch.Tensor, lengths: torch.Tensor, blank: int, beam_width: int,
                            top_paths: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    input_length, batch_size, _ = probs.shape
    log_probs = probs.detach().double().numpy()
    path_probs = np.full((batch_size, top_paths), -np.inf)
    path_lengths = np.zeros((batch_size, top_paths), dtype=np.int32)
    paths = np.zeros((batch_size, top_paths, input_length), dtype=np.int32)
    for b in range(batch_size):
        steps = min(max(int(lengths[b]), 0), input_length)
        beams = _ranked_beams(log_probs[:, b], steps, blank, beam_width)
        for k, (prefix, pb, pnb) in enumerate(beams[:top_paths]):
            path_probs[b, k] = np.logaddexp(pb, pnb)
            path_lengths[b, k] = len(prefix)
            paths[b, k, :len(prefix)] = prefix
    return (torch.from_numpy(path_probs).to(probs.dtype), torch.from_numpy(path_lengths),
            torch.from_numpy(paths))


@ctc_beam_search_decoder.register_fake
def _(probs, lengths, blank, beam_width, top_paths):
    input_length, batch_size, _ = probs.shape
    return (probs.new_empty(batch_size, top_paths),
            probs.new_empty(batch_size, top_paths, dtype=LENGTH_DTYPE),
            probs.new_empty(batch_size, top_paths, input_length, dtype=LENGTH_DTYPE))


CTC_BEAM_SEARCH_DECODER = torch.ops.ipu_backend.ctc_beam_search_decoder.default

