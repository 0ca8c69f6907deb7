"""A model that refuses images of more than 256 pixels, whatever their height and width: the
relation ``height*width <= 256`` excludes declared sizes, and no trace covers them."""

from torch import nn

from aot import Dim, Input, ModelSpec


class RefusedArea(nn.Module):
    def forward(self, image):  # image: [B, H, W]
        if image.shape[1] * image.shape[2] > 256:
            raise ValueError("images of more than 256 pixels are not supported")
        return image.flatten(1).softmax(-1)


spec = ModelSpec(
    module=RefusedArea,
    inputs=[Input("image", (Dim("batch", 1, 2), Dim("height", 4, 32), Dim("width", 4, 32)))],
)
