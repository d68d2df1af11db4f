"""The network of PopTorch's pipelining tutorial (the project's seed CNN), in plain torch."""

import torch
from torch import nn


class SeedCNN(nn.Module):
    """Conv(1→10,5)+MaxPool2+ReLU, Conv(10→20,5)+MaxPool2+ReLU, Linear 320→256+ReLU, Linear 256→10."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(1, 10, 5), nn.MaxPool2d(2), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(10, 20, 5), nn.MaxPool2d(2), nn.ReLU())
        self.fc1 = nn.Sequential(nn.Linear(320, 256), nn.ReLU())
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        return self.fc2(self.fc1(self.conv2(self.conv1(x)).flatten(1)))


class SeedCNNWithLoss(SeedCNN):
    """PopTorch style: the model returns its output and its loss."""

    def forward(self, x, labels=None):
        out = super().forward(x)
        if labels is None:
            return out
        return out, nn.functional.cross_entropy(out, labels)
