"""PopTorch's pipelining tutorial on emulated IPUs: the conv net split into four blocks B1–B4,
one per IPU, trained with AdamW and gradient accumulation, pipelined or sharded — on
scikit-learn's handwritten digits upsampled to 28×28 (an MNIST stand-in that ships offline).

    python pipelining.py                                  # pipelined over 4 IPUs
    python pipelining.py --strategy sharded --profile     # one stage at a time; reports in profile/
    python pipelining.py --offload-optimiser              # AdamW state in host memory
    python pipelining.py --epochs 2 --train-images 560 --test-images 80 --learning-rate 0.003 \
        --device-iterations 1 --gradient-accumulation 7    # CI's reduced run

Prints the loss and accuracy per epoch and the test accuracy. ``--profile`` calls
``opts.enableProfiling(--profile-dir)``: the compile report (each IPU's memory, FLOPs per stage) and
the execution report (the pipeline diagram) of the training and inference models, as HTML pages.
"""

import argparse
import logging
import time

import torch
import torch.nn as nn

import ipu_backend as poptorch
from digits import digits_tensors


class ConvLayer(nn.Module):
    def __init__(self, in_channels, num_filters, kernel_size, pool_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, num_filters, kernel_size=kernel_size)
        self.pool = nn.MaxPool2d(kernel_size=pool_size)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.pool(self.conv(x)))


class Network(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = ConvLayer(1, 10, 5, 2)
        self.layer2 = ConvLayer(10, 20, 5, 2)
        self.layer3 = nn.Linear(320, 256)
        self.layer3_act = nn.ReLU()
        self.layer4 = nn.Linear(256, 10)

    def forward(self, x):
        with poptorch.Block("B1"):
            x = self.layer1(x)
        with poptorch.Block("B2"):
            x = self.layer2(x)
        with poptorch.Block("B3"):
            x = x.view(-1, 320)
            x = self.layer3_act(self.layer3(x))
        with poptorch.Block("B4"):
            x = self.layer4(x)
        return x


class TrainingModelWithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss = nn.CrossEntropyLoss()

    def forward(self, args, labels=None):
        output = self.model(args)
        if labels is None:
            return output
        with poptorch.Block("B4"):
            loss = self.loss(output, labels)
        return output, loss


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=4, help="training micro-batch size")
    parser.add_argument("--device-iterations", type=int, default=2, help="training device iterations")
    parser.add_argument("--gradient-accumulation", type=int, default=10,
                        help="micro-batches per optimizer step (≥ 7 for a 4-stage pipeline)")
    parser.add_argument("--test-batch-size", type=int, default=8)
    parser.add_argument("--inference-iterations", type=int, default=5,
                        help="inference device iterations (≥ 4 for a 4-stage pipeline)")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--learning-rate", type=float, default=0.001, help="AdamW's learning rate")
    parser.add_argument("--strategy", choices=("pipelined", "sharded"), default="pipelined")
    parser.add_argument("--offload-optimiser", action="store_true", help="keep AdamW's state in host memory")
    parser.add_argument("--profile", action="store_true", help="write compile and execution reports to --profile-dir")
    parser.add_argument("--profile-dir", default="profile")
    parser.add_argument("--debug", action="store_true", help="log the emulation's debug messages")
    parser.add_argument("--train-images", type=int, default=None, help="train on the first N images only")
    parser.add_argument("--test-images", type=int, default=None, help="test on the first N images only")
    return parser.parse_args(argv)


def execution_strategy(name: str):
    stages = [poptorch.Stage(f"B{i + 1}").ipu(i) for i in range(4)]
    return (poptorch.PipelinedExecution if name == "pipelined" else poptorch.ShardedExecution)(*stages)


def accuracy(predictions, labels):
    return (predictions.argmax(1) == labels[-predictions.shape[0]:]).float().mean().item() * 100.0


def train(training_model, training_data, epochs):
    for epoch in range(1, epochs + 1):
        start, losses, accuracies = time.perf_counter(), [], []
        for data, labels in training_data:
            predictions, loss = training_model(data, labels)
            losses.append(loss.mean().item())
            accuracies.append(accuracy(predictions, labels))
        seconds = time.perf_counter() - start
        print(f"Epoch {epoch}/{epochs}: loss {sum(losses) / len(losses):.4f}, accuracy "
              f"{sum(accuracies) / len(accuracies):.2f}%, {len(training_data) * training_data.combinedBatchSize / seconds:,.0f} img/s")


def test(inference_model, test_data):
    correct = total = 0
    for data, labels in test_data:
        predictions = inference_model(data)
        correct += (predictions.argmax(1) == labels).sum().item()
        total += labels.numel()
    print(f"Accuracy on test set: {100.0 * correct / total:.2f}% ({total} images)")
    return 100.0 * correct / total


def main(argv=None) -> float:
    args = parse_arguments(argv)
    if args.debug:
        logging.basicConfig(level=logging.DEBUG)
    torch.manual_seed(0)
    (train_x, train_y), (test_x, test_y) = digits_tensors(train_images=args.train_images,
                                                          test_images=args.test_images)

    train_opts = poptorch.Options().deviceIterations(args.device_iterations).randomSeed(0)
    train_opts.Training.gradientAccumulation(args.gradient_accumulation)
    train_opts.outputMode(poptorch.OutputMode.All)
    train_opts.setExecutionStrategy(execution_strategy(args.strategy))
    if args.profile:
        train_opts.enableProfiling(args.profile_dir)  # the inference options below are its clone
    if args.offload_optimiser:
        train_opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings().useOnChipStorage(False))
    training_data = poptorch.DataLoader(train_opts, torch.utils.data.TensorDataset(train_x, train_y),
                                        batch_size=args.batch_size, shuffle=True)

    model = Network()
    training_model = poptorch.trainingModel(
        TrainingModelWithLoss(model), train_opts,
        optimizer=poptorch.optim.AdamW(model.parameters(), lr=args.learning_rate))
    print(f"{args.strategy} over 4 IPUs: {args.gradient_accumulation} micro-batches of {args.batch_size} "
          f"per step × {args.device_iterations} device iterations = {training_data.combinedBatchSize} images per call")
    train(training_model, training_data, args.epochs)
    training_model.detachFromDevice()

    inf_options = train_opts.clone()
    inf_options.Training.gradientAccumulation(1)
    inf_options.deviceIterations(args.inference_iterations)
    test_data = poptorch.DataLoader(inf_options, torch.utils.data.TensorDataset(test_x, test_y),
                                    batch_size=args.test_batch_size)
    inference_model = poptorch.inferenceModel(model, inf_options)
    test_accuracy = test(inference_model, test_data)
    if args.profile:
        print(f"reports in {args.profile_dir}/training and {args.profile_dir}/inference (completed at exit)")
    return test_accuracy


if __name__ == "__main__":
    main()
