"""Decoding one image into the uint8 CHW array the DataLoader delivers.

Every PIL mode is handled the way transformers' `convert_to_rgb` does (alpha composited on white), so that the
saved image processor sees the same pixels the script trained on; 16/32-bit greyscale is rescaled to 8 bits
instead of being clipped.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageOps

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


def open_image(value) -> Image.Image:
    """Open a datasets Image value (dict with bytes/path), raw bytes, a path or a PIL image."""
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        image = Image.open(io.BytesIO(value))
    else:
        image = Image.open(value)
    image.load()  # decode now, so a truncated file fails here and not in a worker later
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode to RGB, matching transformers.image_transforms.convert_to_rgb for the common modes."""
    image = ImageOps.exif_transpose(image)
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        array = np.asarray(image, dtype=np.float64)
        peak = array.max() if array.size else 0.0
        if peak > 255:
            array = array * (255.0 / (65535.0 if peak <= 65535 else peak))
        return Image.fromarray(np.clip(array, 0, 255).astype(np.uint8), "L").convert("RGB")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def fit(image: Image.Image, height: int, width: int) -> Image.Image:
    """Resize so the image covers height x width (bicubic, antialiased), then centre-crop to exactly that."""
    w, h = image.size
    if (w, h) == (width, height):
        return image
    scale = max(height / h, width / w)
    new_w, new_h = max(width, round(w * scale)), max(height, round(h * scale))
    image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
    left, top = (new_w - width) // 2, (new_h - height) // 2
    return image.crop((left, top, left + width, top + height))


def decode_to_chw(value, height: int, width: int) -> np.ndarray:
    """Decode, convert to RGB and fit to the storage size: a (3, height, width) uint8 array."""
    image = fit(to_rgb(open_image(value)), height, width)
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))


def image_size_of(value) -> tuple[int, int]:
    """(width, height) from the header only, without decoding pixels."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    with Image.open(io.BytesIO(value) if isinstance(value, (bytes, bytearray)) else value) as image:
        return image.size
