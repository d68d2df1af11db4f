"""Porting a PopTorch script: an ordinary PopTorch training script, run on emulated IPUs.

What changed from the PopTorch original is one line, the import:

    import poptorch                   # before: needs Graphcore's SDK and IPU hardware
    import ipu_backend as poptorch    # after: emulated IPUs over JAX/XLA, any machine

Everything else is PopTorch's API as PopTorch documents it: ``poptorch.Options()`` with
``deviceIterations``, ``replicationFactor`` and ``Training.gradientAccumulation``, ``poptorch.DataLoader``
sized by those options, a model that returns its loss, ``poptorch.trainingModel`` with
``poptorch.optim.AdamW``, ``detachFromDevice`` and ``poptorch.inferenceModel`` for testing. The data are
scikit-learn's handwritten digits upsampled to 28×28 (an MNIST stand-in that ships offline).

    python porting_poptorch.py                                            # 4 epochs, full data
    python porting_poptorch.py --epochs 2 --train-images 384 --test-images 64 \
        --device-iterations 1 --gradient-accumulation 1                  # CI's reduced run

Prints the loss per epoch and the test accuracy.
"""

import argparse

import torch
import torch.nn as nn

import ipu_backend as poptorch  # the one line that changed: was ``import poptorch``
from digits import digits_tensors


class ClassificationModel(nn.Module):
    """PopTorch style: the loss is computed inside the model, which returns it with the output."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 10, 5), nn.MaxPool2d(2), nn.ReLU(),
            nn.Conv2d(10, 20, 5), nn.MaxPool2d(2), nn.ReLU(), nn.Flatten())
        self.classifier = nn.Sequential(nn.Linear(320, 256), nn.ReLU(), nn.Linear(256, 10))
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        output = self.classifier(self.features(x))
        if labels is None:
            return output
        return output, self.loss(output, labels)


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="micro-batch size of each replica")
    parser.add_argument("--device-iterations", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--gradient-accumulation", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--train-images", type=int, default=None, help="train on the first N images only")
    parser.add_argument("--test-images", type=int, default=None, help="test on the first N images only")
    args = parser.parse_args(argv)

    (train_x, train_y), (test_x, test_y) = digits_tensors(train_images=args.train_images,
                                                          test_images=args.test_images)
    opts = poptorch.Options()
    opts.deviceIterations(args.device_iterations)
    opts.replicationFactor(args.replicas)
    opts.Training.gradientAccumulation(args.gradient_accumulation)
    opts.randomSeed(0)
    train_loader = poptorch.DataLoader(opts, torch.utils.data.TensorDataset(train_x, train_y),
                                       batch_size=args.batch_size, shuffle=True)

    model = ClassificationModel()
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    training_model = poptorch.trainingModel(model, options=opts, optimizer=optimizer)
    print(f"{args.replicas} replicas, {train_loader.combinedBatchSize} images per call "
          f"({len(train_loader)} calls per epoch)")
    for epoch in range(1, args.epochs + 1):
        total = 0.0
        for data, labels in train_loader:
            _, loss = training_model(data, labels)
            total += loss.mean().item()
        print(f"epoch {epoch}: loss {total / len(train_loader):.4f}")
    training_model.detachFromDevice()

    test_opts = poptorch.Options().deviceIterations(args.device_iterations)
    test_loader = poptorch.DataLoader(test_opts, torch.utils.data.TensorDataset(test_x, test_y),
                                      batch_size=args.batch_size)
    inference_model = poptorch.inferenceModel(model, test_opts)
    correct = tested = 0
    for data, labels in test_loader:
        correct += (inference_model(data).argmax(dim=1) == labels).sum().item()
        tested += len(labels)
    print(f"test accuracy {100.0 * correct / tested:.2f}% ({tested} images)")
    return correct / tested


if __name__ == "__main__":
    main()
