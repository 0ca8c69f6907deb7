"""A ResNet-18-shaped CNN at 224×224 with a dynamic batch (BasicBlocks [2, 2, 2, 2])."""

from torch import nn

from aot import Dim, Input, ModelSpec


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):  # x: [B, C, H, W]
        out = self.bn1(self.conv1(x)).relu()
        out = self.bn2(self.conv2(out))
        return (out + (x if self.down is None else self.down(x))).relu()


class ResNet18(nn.Module):
    def __init__(self, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)
        for m in self.modules():  # non-trivial running stats, so batch norm is really exercised
            if isinstance(m, nn.BatchNorm2d):
                nn.init.uniform_(m.running_mean, -0.1, 0.1)
                nn.init.uniform_(m.running_var, 0.5, 1.5)

    def forward(self, x):  # x: [B, 3, 224, 224]
        x = self.layers(self.stem(x))
        return self.fc(x.mean(dim=(2, 3)))


batch = Dim("batch", 1, 32, buckets=(1, 2, 4, 8, 16, 32), example=2)
spec = ModelSpec(module=ResNet18, inputs=[Input("image", (batch, 3, 224, 224))], dtype="float16")
