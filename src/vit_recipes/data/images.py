"""One image to the uint8 CHW array the DataLoader delivers, as RGB the way transformers' `convert_to_rgb` makes it."""

import io
import math
import os

import numpy as np
from datasets.packaged_modules.imagefolder.imagefolder import IMAGE_EXTENSIONS as IMAGEFOLDER_EXTENSIONS
from PIL import Image, ImageOps

try:  # iPhones' HEIC photos: PIL reads them with this plugin where it is installed (setup.cfg's extra `heif`)
    from pillow_heif import register_heif_opener
except ImportError:
    pass
else:
    register_heif_opener()

HEIF_EXTENSIONS = (".heic", ".heif")
# What datasets' imagefolder reads (`.jfif` and `.jpe` too: a folder indexed here keeps what `load_dataset` would),
# and beyond it AVIF and HEIC/HEIF, where PIL has an opener for them (folder_index leaves the others out, in a line).
IMAGE_EXTENSIONS = (*IMAGEFOLDER_EXTENSIONS, ".avif", *HEIF_EXTENSIONS)
HIGH_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")


def _file(value):
    """A datasets Image value (dict with bytes/path), raw bytes or a path, as something PIL can open."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    return io.BytesIO(value) if isinstance(value, (bytes, bytearray)) else value


class ImageTooLarge(ValueError):
    """Over PIL's decompression-bomb limit, and not a JPEG that decoding at reduced scale brings within it."""


def _open(value) -> Image.Image:
    """Image.open. PIL refuses any image over twice `Image.MAX_IMAGE_PIXELS` (its decompression-bomb guard, 179 MP)
    before decoding it, a 200-megapixel phone photo included. A JPEG decodes at down to 1/8 scale here (draft, in
    decode_to_chw), so one whose eighth is within the limit opens anyway; any other is ImageTooLarge ("too large")."""
    try:
        return Image.open(_file(value))
    except Image.DecompressionBombError as err:
        limit = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = None  # this process's guard, lifted for one header read
        try:
            image = Image.open(_file(value))
        finally:
            Image.MAX_IMAGE_PIXELS = limit
        if image.format == "JPEG" and image.width * image.height <= 64 * limit:
            return image
        image.close()
        raise ImageTooLarge(f"{image.width}x{image.height} px, over PIL's limit of {2 * limit} px") from err


LOST = ("not found", "too large", "unreadable")  # why an image was skipped (problem_of)


def problem_of(err: BaseException) -> str:
    """Why an image could not be decoded, as skipped_images.json and predictions.csv name it (one of LOST)."""
    if isinstance(err, FileNotFoundError):
        return "not found"
    return "too large" if isinstance(err, ImageTooLarge) else "unreadable"


def image_path(value) -> str | None:
    """The file a datasets Image value points at (None for an image stored as bytes)."""
    return value.get("path") if isinstance(value, dict) else None


def stored_size(value) -> int | None:
    """Bytes an image takes as stored: its encoded bytes, or its file's size."""
    source = _file(value)
    if isinstance(source, io.BytesIO):
        return source.getbuffer().nbytes
    return os.path.getsize(source) if isinstance(source, str) and os.path.isfile(source) else None


def white_level(peak: float) -> float:
    """White of the smallest bit depth holding `peak` (12-bit data in a 16-bit file: 4095); 1.0 for floats in (0, 1]."""
    if peak <= 1.0:
        return 1.0 if peak > 0 else 255.0  # all black: nothing to scale
    return float(next((2**bits - 1 for bits in (8, 10, 12, 14, 16) if peak <= 2**bits - 1), 2**32 - 1))


BRIGHTER = "own white level"  # decode_to_chw's tag: a high-bit-depth image brighter than the dataset's white level


def _high_bits_to_8(image: Image.Image, white: float | None) -> tuple[Image.Image, bool]:
    """High-bit-depth greyscale scaled by 255 / `white`, and whether its own bit depth's white replaced `white`: an
    image brighter than the dataset's level (met after the 64 images that set it) would be clipped to white."""
    array = np.asarray(image, dtype=np.float64)
    own = white_level(array.max() if array.size else 0.0)
    scaled = np.clip(array * (255.0 / max(white or 0.0, own)), 0, 255).astype(np.uint8)
    return Image.fromarray(scaled, "L").convert("RGB"), bool(white) and own > white


def to_rgb(image: Image.Image, white: float | None = None) -> Image.Image:
    """Any PIL mode to RGB (alpha composited on white); high-bit-depth greyscale scaled by 255 / `white` (or its own
    bit depth's, where that is larger or `white` is None)."""
    return _to_rgb(image, white)[0]


def _to_rgb(image: Image.Image, white: float | None) -> tuple[Image.Image, bool]:
    image = ImageOps.exif_transpose(image)
    if image.mode == "RGB":
        return image, False
    if image.mode in HIGH_BIT_MODES:
        return _high_bits_to_8(image, white)
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB"), False
    return image.convert("RGB"), False


def decode_to_chw(value, height: int, width: int, white: float | None = None) -> tuple[np.ndarray, str]:
    """A datasets Image value, bytes or path as RGB fitted to (3, height, width) uint8, and what was done to fit it:
    "" (nothing), or comma-separated "resized", "cropped" (over half its area cut to fit the shape), "first frame",
    BRIGHTER (scaled by its own white level, above `white`)."""
    image = _open(value)
    done = ["first frame"] if getattr(image, "n_frames", 1) > 1 else []  # PIL decodes frame 0 of a GIF/WebP/TIFF
    if image.format == "JPEG":  # decode at 1/2, 1/4 or 1/8 scale where that still covers the shape (DCT scaling),
        scale = max(width, height) / min(image.size)  # in either orientation (EXIF may rotate it next)
        image.draft("RGB", (math.ceil(image.width * scale), math.ceil(image.height * scale)))
    image.load()  # decode now, so a truncated file fails here and not in a worker later
    image, brighter = _to_rgb(image, white)
    done += [BRIGHTER] if brighter else []
    if image.size != (width, height):  # cover height x width, then centre-crop (bicubic, antialiased)
        aspect = (image.width / image.height) / (width / height)
        done += ["resized"] + (["cropped"] if max(aspect, 1 / aspect) > 2 else [])
        image = ImageOps.fit(image, (width, height), Image.Resampling.BICUBIC)
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)), ",".join(done)


def probe(value) -> tuple[tuple[int, int], float | None]:
    """(width, height) from the header, and the largest pixel value of a high-bit-depth image (None for 8 bits)."""
    with _open(value) as image:
        return image.size, float(np.asarray(image).max(initial=0)) if image.mode in HIGH_BIT_MODES else None
