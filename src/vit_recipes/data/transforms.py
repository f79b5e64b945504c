"""Batched image transforms on the training device: uint8 (B, 3, H, W) at storage size -> normalised (B, 3, S, S).
Train: random-resized crop and flip in one bilinear `grid_sample` (no antialiasing: storage is at most ~1.14x the model
size, crops only enlarge), then optional RandAugment/TrivialAugmentWide with torchvision's ops and magnitudes (geometric
ops bilinear, black fill; torchvision: nearest; the first round's geometric op shares the crop's one resampling pass),
with no device sync: the CPU launches the step's kernels ahead of the GPU. Random draws come from a `Randomness` per
batch (crops on the device, ops on the CPU), or the global RNGs when none is given. Eval matches the saved PIL
bicubic image processor within 1-2 levels (antialiased bicubic in two passes rounded to uint8), so scores carry over."""

import dataclasses
import functools
import hashlib
import math
import random
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

NUM_MAGNITUDE_BINS = 31  # torchvision's RandAugment/TrivialAugmentWide default: magnitudes 0..30
GRAY_WEIGHTS = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale
CROP_RATIO, CROP_ATTEMPTS = (3 / 4, 4 / 3), 10  # torchvision RandomResizedCrop's defaults


@dataclasses.dataclass
class Randomness:
    """Where one training batch's augmentation draws from; the defaults are torch's and Python's global RNGs.

    The Trainer seeds every rank alike, so global RNGs give image i of every rank's batch the same crop, flip, op and
    mixup draw. `for_batch` seeds per (seed, rank, step, micro-batch) instead: ranks differ, and a resumed run redraws
    what the uninterrupted one drew with no RNG state to restore. (Seeding the global RNGs with seed + rank, as
    accelerate's `set_seed(device_specific=True)` does, would also move accelerate's seedable sampler, whose ranks
    must draw the same permutation.)"""

    host: torch.Generator | None = None  # the CPU's draws: RandAugment/TrivialAugment's ops, bins and signs
    device: torch.Generator | None = None  # the batch device's draws: crops, flips, erasing boxes and noise
    python: random.Random = random  # mixup's few scalars (Beta has no torch generator argument)

    @classmethod
    def for_batch(cls, seed: int, rank: int, step: int, micro_batch: int, device) -> "Randomness":
        key = hashlib.blake2b(f"{seed}/{rank}/{step}/{micro_batch}".encode(), digest_size=8).digest()
        number = int.from_bytes(key, "little") >> 1  # < 2**63: any generator's seed
        host = torch.Generator().manual_seed(number)
        on_device = host if torch.device(device).type == "cpu" else torch.Generator(device).manual_seed(number)
        return cls(host, on_device, random.Random(number))


class _Normalized(nn.Module):
    """Holds the image processor's mean/std as buffers, so `.to(device)` moves them."""

    def __init__(self, image_size: int, mean: float | Sequence[float], std: float | Sequence[float]):
        super().__init__()
        self.image_size = int(image_size)
        mean, std = (torch.as_tensor(v, dtype=torch.float32).reshape(-1, 1, 1) for v in (mean, std))
        self.register_buffer("mean", mean, persistent=False)
        self.register_buffer("std", std, persistent=False)
        self.register_buffer("scale", 1 / (255 * std), persistent=False)  # (x / 255 - mean) / std in one kernel
        self.register_buffer("shift", -mean / std, persistent=False)

    def normalize(self, x: Tensor) -> Tensor:
        return torch.addcmul(self.shift, x, self.scale)


def sample_crop_flip_theta(
    batch: int, height: int, width: int, scale: tuple[float, float], hflip_prob: float, device="cpu", generator=None
) -> Tensor:
    """`affine_grid` thetas (B, 2, 3): torchvision's RandomResizedCrop sampling and a flip, batched, per sample.
    Written for few kernels (about 25; each costs the host a launch at every step): the attempts' widths and heights
    as one (B, attempts, 2) tensor, the constants made once per device (`_crop_constants`)."""
    u = torch.rand(batch, 2 * CROP_ATTEMPTS + 3, device=device, generator=generator)  # one RNG call for everything
    size, u_scale, u_offset, fallback, signs = _crop_constants(height, width, scale, torch.device(device))
    flip = torch.where(u[:, -1:] < hflip_prob, -1.0, 1.0)  # (B, 1)
    if scale[0] >= 1:
        wh, xy0 = size.expand(batch, 2), torch.zeros(batch, 2, device=device)
    else:
        # columns -> sqrt(area) (attempts), log(aspect) / 2 (attempts), then u_x, u_y, u_flip as drawn
        v = torch.addcmul(u_offset, u, u_scale)
        root_area, half_log_aspect = v[:, :CROP_ATTEMPTS].sqrt(), v[:, CROP_ATTEMPTS:-3]
        # w = sqrt(area) * sqrt(aspect), h = sqrt(area) / sqrt(aspect): (B, attempts, 2)
        wh = root_area.unsqueeze(-1) * torch.exp(half_log_aspect.unsqueeze(-1) * signs)
        found, first = first_fit((wh <= size).all(-1))
        wh = torch.where(found[:, None], wh.gather(1, first.view(-1, 1, 1).expand(-1, 1, 2)).squeeze(1), fallback)
        xy0 = (size - wh) * torch.where(found[:, None], u[:, -3:-1], 0.5)  # the fallback is centred
    # Normalised coords (align_corners=False): the box [x0, x0 + w] maps to [-1, 1]; a flip negates the x scale.
    scales, centres = wh / size, torch.add(wh, xy0, alpha=2) / size - 1
    zero = torch.zeros_like(flip)
    rows = [scales[:, :1] * flip, zero, centres[:, :1], zero, scales[:, 1:], centres[:, 1:]]
    return torch.cat(rows, 1).view(-1, 2, 3)


def first_fit(fits: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of `fits` (B, attempts): whether any attempt fits, and the first that does (0 where none). One kernel:
    `max` returns the first of equal maxima."""
    return fits.max(1)


@functools.lru_cache(maxsize=16)
def _crop_constants(height: int, width: int, scale: tuple[float, float], device: torch.device) -> tuple[Tensor, ...]:
    """Per storage size and device: (W, H), the affine map of the crop's uniforms (to area and log(aspect) / 2), the
    fallback box (the whole image, trimmed to CROP_RATIO) and the signs taking log(aspect) / 2 to (w, h). Made once:
    tensors built per call cost launches, and a CPU -> GPU copy of them every step."""
    area, (log_lo, log_hi) = height * width, (math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1]))
    u_scale = [area * (scale[1] - scale[0])] * CROP_ATTEMPTS + [(log_hi - log_lo) / 2] * CROP_ATTEMPTS + [1.0] * 3
    u_offset = [area * scale[0]] * CROP_ATTEMPTS + [log_lo / 2] * CROP_ATTEMPTS + [0.0] * 3
    (low, high), aspect = CROP_RATIO, width / height
    fallback = (height * high if aspect > high else width, width / low if aspect < low else height)
    made = ([width, height], u_scale, u_offset, fallback, [1.0, -1.0])
    return tuple(torch.tensor(values, dtype=torch.float32).to(device) for values in made)


@functools.lru_cache(maxsize=16)
def _pixel_centres(size: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    return (torch.arange(size, device=device, dtype=dtype) * 2 + 1) / size - 1  # normalised, align_corners=False


def affine_grid(theta: Tensor, size: int) -> Tensor:
    """`F.affine_grid(..., align_corners=False)` by elementwise passes: its 3-wide batched matmul is slow on GPUs."""
    coords = _pixel_centres(size, theta.device, theta.dtype)
    xs, ys = coords.view(1, 1, size), coords.view(1, size, 1)
    t = theta.view(-1, 6, 1, 1).unbind(1)
    return torch.stack([torch.addcmul(t[0] * xs + t[2], t[1], ys), torch.addcmul(t[3] * xs + t[5], t[4], ys)], dim=-1)


def resample(x: Tensor, theta: Tensor, size: int, padding_mode: str) -> Tensor:
    grid = affine_grid(theta.to(x.dtype), size)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode=padding_mode, align_corners=False)


# The geometric ops as torchvision's inverse maps about the image centre: output pixel p (in pixels from the centre)
# samples [[a, b], [c, d]] @ p + (tx, ty). m: the magnitudes (a tensor), s: the image's side.
WARPS: dict[str, Callable[[Tensor, int], tuple]] = {
    "ShearX": lambda m, s: (1, m, 0, 1, m * s / 2, 0),  # x_in = x + m * (y - top)
    "ShearY": lambda m, s: (1, 0, m, 1, 0, m * s / 2),  # y_in = y + m * (x - left)
    "TranslateX": lambda m, s: (1, 0, 0, 1, -m.trunc(), 0),  # torchvision shifts by int(m) pixels
    "TranslateY": lambda m, s: (1, 0, 0, 1, 0, -m.trunc()),
    "Rotate": lambda m, s: _rotation(torch.deg2rad(m)),  # counter-clockwise
}


def _rotation(radians: Tensor) -> tuple:
    cos, sin = radians.cos(), radians.sin()
    return cos, -sin, sin, cos, 0, 0


def warp_theta(name: str, m: Tensor, size: int) -> Tensor:
    """The `affine_grid` thetas (n, 2, 3) of geometric op `name` at magnitudes m on square images of side `size`."""
    a, b, c, d, tx, ty = WARPS[name](m, size)
    half = size / 2  # square images: normalised coords are pixels / half on both axes
    zero = torch.zeros_like(m)
    return torch.stack([zero + v for v in (a, b, tx / half, c, d, ty / half)], 1).view(-1, 2, 3)


def _warp(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda x, m: resample(x, warp_theta(name, m, x.shape[-1]), x.shape[-1], padding_mode="zeros")


def crop_and_warp(x: Tensor, crop: Tensor, warp: Tensor, size: int) -> Tensor:
    """The crop and flip (`crop`, diagonal thetas), then a geometric op per sample (`warp` thetas, identity where none)
    in one bilinear pass: each output pixel's place q in the cropped image is mapped on into the source. Pixels whose
    q falls outside the crop are black, weighted as zero padding would (1 inside, down to 0 a pixel beyond the edge).
    Resampling once, not twice, also spares the image a second interpolation's blur."""
    q = affine_grid(warp.to(x.dtype), size)  # (B, S, S, 2)
    scale, offset = crop[:, :, :2].diagonal(dim1=1, dim2=2), crop[:, :, 2]  # (B, 2) each; crops do not rotate
    grid = torch.addcmul(offset.view(-1, 1, 1, 2).to(x.dtype), q, scale.view(-1, 1, 1, 2).to(x.dtype))
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    # per axis, the weight on in-bounds pixels: (1 - |q|) * size / 2 + 1/2, clamped to 0..1
    inside = q.abs().mul_(-size / 2).add_(size / 2 + 0.5).clamp_(0, 1).prod(-1)
    return out * inside.unsqueeze(1)


def _blend(x: Tensor, degenerate: Tensor, factor: Tensor) -> Tensor:
    """torchvision/PIL enhance: interpolate (or extrapolate) from a degenerate image towards x (two kernels)."""
    return torch.lerp(degenerate, x, factor.view(-1, 1, 1, 1)).clamp_(0, 255)


@functools.lru_cache(maxsize=16)
def _filters(device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Made once per device: the grey weights (1, 3, 1, 1) and PIL's SMOOTH kernel (1, 1, 3, 3). Made per call they
    cost launches, and a torch.tensor(..., device=cuda) would be a blocking copy (a device sync) every step."""
    smooth = torch.full((1, 1, 3, 3), 1 / 13, dtype=dtype)
    smooth[..., 1, 1] = 5 / 13
    return torch.tensor(GRAY_WEIGHTS, dtype=dtype).view(1, 3, 1, 1).to(device), smooth.to(device)


def _grayscale(x: Tensor) -> Tensor:
    return (x * _filters(x.device, x.dtype)[0]).sum(1, keepdim=True)


def sharpness(x: Tensor, m: Tensor) -> Tensor:
    """Blend with PIL's SMOOTH-filtered image; the 1-pixel border keeps the original (as PIL and torchvision)."""
    n, c, h, w = x.shape
    degenerate = x.clone()
    smooth = _filters(x.device, x.dtype)[1]
    degenerate[..., 1:-1, 1:-1] = F.conv2d(x.reshape(n * c, 1, h, w), smooth).view(n, c, h - 2, w - 2)
    return _blend(x, degenerate, 1 + m)


def posterize(x: Tensor, bits: Tensor) -> Tensor:
    """Keeps the top `bits` bits of the nearest uint8 level (posterize and equalize are defined on uint8 images)."""
    step = (2.0 ** (8 - bits.round())).view(-1, 1, 1, 1)
    return torch.div(x.round().clamp(0, 255), step, rounding_mode="floor") * step


def autocontrast(x: Tensor, m: Tensor) -> Tensor:
    """Stretch each channel to 0..255; flat channels are left alone."""
    lo, hi = (v.unsqueeze(-1) for v in torch.aminmax(x.flatten(2), dim=-1, keepdim=True))  # (n, c, 1, 1) each
    flat = hi <= lo
    scale = torch.where(flat, 1.0, 255 / (hi - lo).clamp(min=1e-6))
    return ((x - torch.where(flat, 0.0, lo)) * scale).clamp(0, 255)


@functools.lru_cache(maxsize=1024)
def _arange(stop: int, step: int, device: torch.device) -> Tensor:
    """torch.arange(0, stop, step) on `device`, made once per size: equalize needs a few per call (launches)."""
    return torch.arange(0, stop, step, device=device)


def equalize(x: Tensor, m: Tensor) -> Tensor:
    """Per-image, per-channel PIL.ImageOps.equalize (= torchvision's); one bincount over (image, channel, level)."""
    n, c, h, w = x.shape
    levels = x.round().clamp_(0, 255).long().view(n * c, h * w)
    ids = (levels + _arange(256 * n * c, 256, x.device).unsqueeze(1)).view(-1)  # one histogram per image, channel
    # scatter_add, not bincount: CUDA's bincount reads the largest id back to the host (a device sync per step)
    hist = torch.zeros(n * c * 256, dtype=torch.long, device=x.device)
    hist = hist.scatter_add_(0, ids, _arange(2, 1, x.device)[1].expand_as(ids)).view(n * c, 256)  # adds 1 per pixel
    top_count = hist.gather(1, levels.amax(1, keepdim=True))  # pixels at the brightest level present
    step = torch.div(h * w - top_count, 255, rounding_mode="floor")
    below = hist.cumsum(1) - hist  # pixels strictly darker than each level
    lut = torch.div(step // 2 + below, step.clamp(min=1), rounding_mode="floor").clamp(max=255)
    lut = torch.where(step > 0, lut, _arange(256, 1, x.device))  # near-flat channels: unchanged
    return lut.gather(1, levels).view(n, c, h, w).to(x.dtype)


# (n, 3, S, S) floats in 0..255 and magnitudes m (n,) -> same shape; geometric ops use torchvision's inverse maps.
OPS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "Identity": lambda x, m: x,
    **{name: _warp(name) for name in WARPS},  # ShearX, ShearY, TranslateX, TranslateY, Rotate
    "Brightness": lambda x, m: torch.addcmul(x, x, m.view(-1, 1, 1, 1)).clamp_(0, 255),  # x * (1 + m)
    "Color": lambda x, m: _blend(x, _grayscale(x), 1 + m),
    "Contrast": lambda x, m: _blend(x, _grayscale(x).mean((1, 2, 3), keepdim=True), 1 + m),
    "Sharpness": sharpness,
    "Posterize": posterize,
    "Solarize": lambda x, m: torch.where(x >= m.view(-1, 1, 1, 1), 255 - x, x),
    "AutoContrast": autocontrast,
    "Equalize": equalize,
}


def augmentation_space(policy: str, image_size: int) -> dict[str, tuple[Tensor, bool]]:
    """op name -> (magnitude per bin, signed), torchvision's RandAugment / TrivialAugmentWide tables."""
    bins = NUM_MAGNITUDE_BINS
    wide = policy == "trivialaugment"
    enhance, shear, rotation = (0.99, 0.99, 135.0) if wide else (0.9, 0.3, 30.0)
    shift = 32.0 if wide else 150.0 / 331.0 * image_size
    posterize_span = 6 if wide else 4  # bits go 8 -> 2 (wide) or 8 -> 4
    none = torch.zeros(bins)
    signed = {"ShearX": shear, "ShearY": shear, "TranslateX": shift, "TranslateY": shift, "Rotate": rotation}
    signed.update(dict.fromkeys(("Brightness", "Color", "Contrast", "Sharpness"), enhance))
    return {  # in torchvision's order: op ids index it
        "Identity": (none, False),
        **{name: (torch.linspace(0.0, top, bins), True) for name, top in signed.items()},
        "Posterize": (8 - (torch.arange(bins) / ((bins - 1) / posterize_span)).round(), False),
        "Solarize": (torch.linspace(255.0, 0.0, bins), False),
        **dict.fromkeys(("AutoContrast", "Equalize"), (none, False)),
    }


def host_to_device(device, *tensors: Tensor) -> list[Tensor]:
    """CPU tensors copied to `device` without the host waiting: pinned first, a pageable copy would block."""
    if torch.device(device).type != "cuda":
        return [t.to(device) for t in tensors]
    return [t.pin_memory().to(device, non_blocking=True) for t in tensors]


def apply_per_sample_ops(x: Tensor, op_ids: Tensor, magnitudes: Tensor, names: Sequence[str]) -> Tensor:
    """Op names[op_ids[i]] with magnitudes[i] on sample i: one batched call per op, on the samples that drew it.

    op_ids live on the CPU: the samples are sorted by op there, so every op's group is a slice whose bounds the host
    already knows. Selecting them on the device (`nonzero`, a boolean index) reads a count back per op: ~13 device
    syncs a step, each draining the queue of kernels the CPU had launched ahead."""
    op_ids, magnitudes = op_ids.cpu(), magnitudes.cpu()
    order = torch.argsort(op_ids, stable=True)
    counts = torch.bincount(op_ids, minlength=len(names)).tolist()
    device_order, magnitudes = host_to_device(x.device, order, magnitudes)
    grouped, m = x[device_order], magnitudes[device_order]
    parts, start = [], 0
    for name, count in zip(names, counts):
        if count:
            part = grouped[start : start + count]
            parts.append(part if name == "Identity" else OPS[name](part, m[start : start + count]))
        start += count
    out = torch.empty_like(x)
    out[device_order] = torch.cat(parts)  # back to the batch's order (labels were not moved)
    return out


class RandomOps:
    """RandAugment (fixed magnitude bin, `num_ops` rounds) or TrivialAugmentWide (one op, uniform bin), per sample.
    Ops, bins and signs are drawn on the CPU: a few hundred numbers, and the host needs the ops."""

    def __init__(self, policy: str, image_size: int, num_ops: int = 2, magnitude: int = 9):
        # policy and magnitude are checked with the arguments (arguments.validate_arguments)
        space = augmentation_space(policy, image_size)
        self.names, self.image_size = list(space), int(image_size)
        self.uniform_magnitude = policy == "trivialaugment"
        self.num_ops = 1 if self.uniform_magnitude else int(num_ops)
        self.magnitude = int(magnitude)
        self.table = torch.stack([m for m, _ in space.values()])  # CPU tensors: sampling happens there
        self.signed = torch.tensor([s for _, s in space.values()])
        self.is_warp = torch.tensor([name in WARPS for name in self.names])  # per op id, like `signed`

    def __call__(self, x: Tensor, crop: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """x (uncropped, float) cropped by the `crop` thetas, then the policy's rounds. All rounds are drawn up front:
        the first round's geometric ops join the crop's resampling (crop_and_warp), about half of the policy's kernel
        launches otherwise, which the host pays at every step."""
        rounds = [self.sample(x.shape[0], generator) for _ in range(self.num_ops)]
        (first_ops, first_magnitudes), later = rounds[0], rounds[1:]
        warp, first_ops = self.take_warps(first_ops, first_magnitudes)
        x = crop_and_warp(x, crop, *host_to_device(x.device, warp), self.image_size)
        for op_ids, magnitudes in [(first_ops, first_magnitudes), *later]:
            x = apply_per_sample_ops(x, op_ids, magnitudes, self.names)
        return x

    def sample(self, batch: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Per sample (on the CPU): an op id, and its magnitude with a random sign for signed ops."""
        op_ids = torch.randint(len(self.names), (batch,), generator=generator)
        if self.uniform_magnitude:
            bins = torch.randint(NUM_MAGNITUDE_BINS, (batch,), generator=generator)
        else:
            bins = torch.full((batch,), self.magnitude)
        negate = (torch.rand(batch, generator=generator) < 0.5) & self.signed[op_ids]
        return op_ids, self.table[op_ids, bins] * torch.where(negate, -1.0, 1.0)

    def take_warps(self, op_ids: Tensor, magnitudes: Tensor) -> tuple[Tensor, Tensor]:
        """The geometric ops drawn (CPU) as `affine_grid` thetas (B, 2, 3) for `crop_and_warp`, identity elsewhere,
        and the op ids left for `apply_per_sample_ops`: Identity where a warp was taken."""
        theta = torch.eye(2, 3).repeat(len(op_ids), 1, 1)
        for name in WARPS:
            drawn = op_ids == self.names.index(name)
            if drawn.any():
                theta[drawn] = warp_theta(name, magnitudes[drawn], self.image_size)
        return theta, torch.where(self.is_warp[op_ids], self.names.index("Identity"), op_ids)


def random_erase(x: Tensor, prob: float, attempts: int = 10, generator: torch.Generator | None = None) -> Tensor:
    """timm's RandomErasing ('pixel' mode, one box, first of `attempts` draws that fits) batched; x is normalised."""
    batch, _, height, width = x.shape
    u = torch.rand(batch, 2 * attempts + 3, device=x.device, generator=generator)
    area = height * width * (0.02 + (1 / 3 - 0.02) * u[:, :attempts])
    aspect = torch.exp(math.log(0.3) + (math.log(3.3) - math.log(0.3)) * u[:, attempts:-3])
    h, w = (area * aspect).sqrt().round(), (area / aspect).sqrt().round()
    found, first = first_fit((h < height) & (w < width))
    h, w = h.gather(1, first[:, None]).squeeze(1), w.gather(1, first[:, None]).squeeze(1)
    erase = found & (u[:, -1] < prob)
    top, left = (((size - side + 1) * v).floor() for size, side, v in ((height, h, u[:, -3]), (width, w, u[:, -2])))
    rows, cols = torch.arange(height, device=x.device), torch.arange(width, device=x.device)
    inside_rows = (rows >= top[:, None]) & (rows < (top + h)[:, None])
    inside_cols = (cols >= left[:, None]) & (cols < (left + w)[:, None])
    box = erase[:, None, None, None] & inside_rows[:, None, :, None] & inside_cols[:, None, None, :]
    noise = torch.randn(x.shape, dtype=x.dtype, device=x.device, generator=generator)
    return torch.where(box, noise, x)


class TrainTransform(_Normalized):
    """Random-resized crop + flip, optional RandAugment, normalise, optional random erasing (uint8 in, float32 out)."""

    def __init__(self, image_size: int, mean, std, crop_scale_min=0.08, hflip_prob=0.5, auto_augment="none",
                 randaugment_num_ops=2, randaugment_magnitude=9, random_erasing=0.0):  # fmt: skip
        super().__init__(image_size, mean, std)
        self.crop_scale, self.hflip_prob = (float(crop_scale_min), 1.0), float(hflip_prob)
        self.random_erasing, self.random_ops = float(random_erasing), None
        if auto_augment not in (None, "none"):
            self.random_ops = RandomOps(auto_augment, image_size, randaugment_num_ops, randaugment_magnitude)

    def forward(self, pixels: Tensor, randomness: Randomness | None = None) -> Tensor:
        rng = randomness or Randomness()
        x = pixels.float()
        batch, _, height, width = x.shape
        crop = sample_crop_flip_theta(batch, height, width, self.crop_scale, self.hflip_prob, x.device, rng.device)
        if self.random_ops is None:
            x = resample(x, crop, self.image_size, padding_mode="border")  # border: edge pixels, as a resize would
        else:
            x = self.random_ops(x, crop, rng.host)
        x = self.normalize(x)
        return random_erase(x, self.random_erasing, generator=rng.device) if self.random_erasing > 0 else x


class EvalTransform(_Normalized):
    """uint8 (B, 3, H, W) -> float32 (B, 3, S, S) like the PIL image processor: resize shorter side, centre-crop."""

    def __init__(self, image_size: int, mean, std, eval_crop_pct: float = 1.0):
        super().__init__(image_size, mean, std)
        self.resize_to = round(image_size / eval_crop_pct)

    def forward(self, pixels: Tensor) -> Tensor:
        x, (height, width), edge = pixels.float(), pixels.shape[-2:], self.resize_to
        # transformers' get_resize_output_image_size(default_to_square=False): the long side is truncated
        if width <= height:
            height, width = int(edge * height / width), edge
        else:
            height, width = edge, int(edge * width / height)
        # PIL's bicubic resize of uint8 images: a horizontal then a vertical pass, each rounded to uint8 levels
        for size in ((x.shape[-2], width), (height, width)):
            if size != tuple(x.shape[-2:]):
                x = F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False)
                x = x.clamp(0, 255).round()
        top, left = (height - self.image_size) // 2, (width - self.image_size) // 2  # transformers' center_crop
        return self.normalize(x[..., top : top + self.image_size, left : left + self.image_size])


def build_transforms(aug_args, image_size: int, mean, std) -> tuple[TrainTransform, EvalTransform]:
    train_fields = ("crop_scale_min", "hflip_prob", "auto_augment", "randaugment_num_ops", "randaugment_magnitude")
    train_fields += ("random_erasing",)
    train = TrainTransform(image_size, mean, std, **{name: getattr(aug_args, name) for name in train_fields})
    return train, EvalTransform(image_size, mean, std, aug_args.eval_crop_pct)


class MixupCutmix:
    """timm's Mixup, 'batch' mode: one lam ~ Beta per batch (Python's RNG), x mixed with x.flip(0) by mixup or cutmix."""

    def __init__(self, mixup_alpha: float, cutmix_alpha: float, num_classes: int, label_smoothing: float = 0.0):
        self.mixup_alpha, self.cutmix_alpha = float(mixup_alpha), float(cutmix_alpha)
        self.num_classes, self.label_smoothing = int(num_classes), float(label_smoothing)

    def __call__(self, pixels: Tensor, labels: Tensor, randomness: Randomness | None = None) -> tuple[Tensor, Tensor]:
        rng = (randomness or Randomness()).python
        both = self.mixup_alpha > 0 and self.cutmix_alpha > 0
        use_cutmix = rng.random() < 0.5 if both else self.cutmix_alpha > 0
        alpha = self.cutmix_alpha if use_cutmix else self.mixup_alpha
        lam = rng.betavariate(alpha, alpha)
        pixels, lam = cutmix(pixels, lam, rng) if use_cutmix else (lam * pixels + (1 - lam) * pixels.flip(0), lam)
        hot = labels if labels.ndim == 2 else F.one_hot(labels.long(), self.num_classes)
        soft = smooth_targets(hot, self.label_smoothing)
        return pixels, lam * soft + (1 - lam) * soft.flip(0)


def smooth_targets(hot: Tensor, smoothing: float) -> Tensor:
    """One-hot or multi-hot targets smoothed as timm does (mixup, BinaryCrossEntropy): 1 -> 1 - s + s/K, 0 -> s/K."""
    off = smoothing / hot.shape[-1]
    return torch.where(hot > 0, 1.0 - smoothing + off, off).float()


def cutmix(pixels: Tensor, lam: float, rng: random.Random = random) -> tuple[Tensor, float]:
    """Paste a box of area ~(1 - lam) from x.flip(0) (timm's rand_bbox); return pixels and the box-corrected lam."""
    height, width = pixels.shape[-2:]
    cut = math.sqrt(1 - lam)
    half_h, half_w = int(height * cut) // 2, int(width * cut) // 2
    cy, cx = rng.randrange(height), rng.randrange(width)
    top, bottom = max(cy - half_h, 0), min(cy + half_h, height)
    left, right = max(cx - half_w, 0), min(cx + half_w, width)
    mixed = pixels.clone()
    mixed[..., top:bottom, left:right] = pixels.flip(0)[..., top:bottom, left:right]
    return mixed, 1 - (bottom - top) * (right - left) / (height * width)


def build_mixup(aug_args, num_classes: int, label_smoothing: float) -> MixupCutmix | None:
    if aug_args.mixup_alpha <= 0 and aug_args.cutmix_alpha <= 0:
        return None
    return MixupCutmix(aug_args.mixup_alpha, aug_args.cutmix_alpha, num_classes, label_smoothing)
