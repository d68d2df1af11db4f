"""Lowerings: losses.

None are needed: with torch's core-ATen decompositions every torch.nn.functional loss in
everyday use (cross_entropy with class indices or probabilities, weight, ignore_index and
label_smoothing; nll_loss; mse, l1, smooth_l1 and huber; binary_cross_entropy with and without
logits; kl_div; and the margin, soft-margin, Poisson and cosine-embedding losses) becomes
log_softmax, gather, where, reductions and elementwise ops, lowered by their own families.
tests/compiler/test_ops_losses.py checks those compositions against torch. A fused loss op that
ever survives decomposition gets its lowering here.
"""
