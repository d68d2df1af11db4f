"""Op parity: poptorch.ctc_beam_search_decoder compiled against its eager kernel
(tests/test_ctc_decoder.py checks both against a reference beam search)."""

import pytest
import torch

import ipu_backend
from ipu_backend.compiler.ctc_decoding import CTC_BEAM_SEARCH_DECODER
from tests.compiler.harness import OpCase, case_params, check_case

CASES = [
    OpCase(f"ctc_beam_search_decoder_width_{width}",
           lambda x, n, width=width: ipu_backend.ctc_beam_search_decoder(x.log_softmax(-1), n, 1, width, 2),
           lambda dtype: (torch.randn(7, 3, 5, dtype=dtype), torch.tensor([7, 4, 0])),
           dtypes=(torch.float32, torch.float16), grad=False, ops=(CTC_BEAM_SEARCH_DECODER,))
    for width in (2, 6)
]


@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_ctc_decoding(case, dtype):
    check_case(case, dtype)
