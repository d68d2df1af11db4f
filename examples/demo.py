"""Demo: the seed CNN trained on 4 emulated IPUs — a 2-stage pipeline (convolutions on one IPU,
the classifier on the next) replicated twice, with gradient accumulation and device iterations —
on scikit-learn's handwritten digits, written as a PopTorch program.

Prints the loss per epoch, throughput and test accuracy.
"""

import time

import torch

import ipu_backend as poptorch
from digits import digits_tensors
from seed_cnn import SeedCNNWithLoss

MICRO_BATCH = 8
EPOCHS = 6


def main():
    torch.manual_seed(0)
    (train_x, train_y), (test_x, test_y) = digits_tensors()
    model = SeedCNNWithLoss()
    poptorch.BeginBlock(model.conv1, "convolutions", ipu_id=0)
    poptorch.BeginBlock(model.fc1, "classifier", ipu_id=1)

    opts = poptorch.Options().deviceIterations(2).replicationFactor(2).randomSeed(0)
    opts.Training.gradientAccumulation(4)
    loader = poptorch.DataLoader(opts, torch.utils.data.TensorDataset(train_x, train_y),
                                 batch_size=MICRO_BATCH, shuffle=True)
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=2e-3)
    training = poptorch.trainingModel(model, opts, optimizer)
    print(f"2 pipeline stages × {opts.replication_factor} replicas = 4 IPUs; "
          f"{opts.Training.gradient_accumulation} accumulated "
          f"micro-batches of {MICRO_BATCH} × {opts.device_iterations} device iterations = "
          f"{loader.combinedBatchSize} images per call")

    start = time.perf_counter()
    training.compile(*next(iter(loader)))
    print(f"compiled the training program in {time.perf_counter() - start:.2f} s")
    for epoch in range(EPOCHS):
        start = time.perf_counter()
        for images, labels in loader:
            _, losses = training(images, labels)
        seconds = time.perf_counter() - start
        print(f"epoch {epoch + 1}: loss {losses.mean():.4f} (per replica {losses.numpy().round(3)}), "
              f"{len(loader) * loader.combinedBatchSize / seconds:,.0f} img/s")

    training.detachFromDevice()
    poptorch.removeBlocks(model)
    inference = poptorch.inferenceModel(model)
    accuracy = (inference(test_x).argmax(-1) == test_y).float().mean()
    print(f"test accuracy {accuracy:.1%} on {len(test_y)} held-out digits")


if __name__ == "__main__":
    main()
