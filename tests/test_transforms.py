"""Batched device transforms: shapes, determinism, each augmentation op against PIL, eval against the HF processor."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageEnhance, ImageOps

from vit_recipes.data import transforms as T

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
POLICIES = ("none", "randaugment", "trivialaugment")


def aug_args(**overrides):
    defaults = dict(
        crop_scale_min=0.08,
        hflip_prob=0.5,
        auto_augment="none",
        randaugment_num_ops=2,
        randaugment_magnitude=9,
        mixup_alpha=0.0,
        cutmix_alpha=0.0,
        eval_crop_pct=1.0,
        random_erasing=0.0,
    )
    return SimpleNamespace(**{**defaults, **overrides})


def random_pixels(batch, height, width, seed=0):
    return torch.randint(
        0, 256, (batch, 3, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def smooth_image(height, width, seed=0):
    """Natural-ish uint8 HWC image: upsampled coarse noise plus fine noise."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    image = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC)).astype(int)
    return np.clip(image + rng.integers(-20, 21, image.shape), 0, 255).astype(np.uint8)


def unnormalize(x):
    return x * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)


def as_float_batch(*images_hwc):
    return torch.stack([torch.from_numpy(np.array(image)).permute(2, 0, 1) for image in images_hwc]).float()


def as_hwc(x_chw):
    return x_chw.permute(1, 2, 0).numpy()


def drawn(seed=0, rank=0, step=0, micro_batch=0, device="cpu"):
    """A training batch's randomness, as the trainer makes it (batches.DeviceBatches.training_step)."""
    return T.Randomness.for_batch(seed, rank, step, micro_batch, device)


# --------------------------------------------------------------------------------------------------- train/eval


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shape", [(32, 32), (256, 320)])
def test_shapes_dtype_and_value_range(policy, shape):
    train, evaluate = T.build_transforms(aug_args(auto_augment=policy), 64, MEAN, STD)
    pixels = random_pixels(4, *shape)
    torch.manual_seed(0)
    for out in (train(pixels), evaluate(pixels)):
        assert out.shape == (4, 3, 64, 64) and out.dtype == torch.float32
        values = unnormalize(out)
        assert values.min() >= -1e-5 and values.max() <= 1 + 1e-5


@pytest.mark.parametrize("policy", POLICIES)
def test_train_is_seeded(policy):
    train, _ = T.build_transforms(aug_args(auto_augment=policy), 48, MEAN, STD)
    pixels = random_pixels(8, 32, 40)
    outputs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        outputs.append(train(pixels))
    assert torch.equal(outputs[0], outputs[1])
    assert not torch.allclose(outputs[0], outputs[2])


def test_eval_is_deterministic_and_consumes_no_randomness():
    _, evaluate = T.build_transforms(aug_args(eval_crop_pct=0.875), 64, MEAN, STD)
    pixels = random_pixels(3, 50, 70)
    state = torch.random.get_rng_state()
    first, second = evaluate(pixels), evaluate(pixels)
    assert torch.equal(first, second)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_eval_is_plain_crop_when_storage_fits():
    _, evaluate = T.build_transforms(aug_args(eval_crop_pct=0.8), 64, 0.0, 1.0)  # resize to 80 = storage: no resample
    pixels = random_pixels(2, 80, 90)
    top, left = (80 - 64) // 2, (90 - 64) // 2
    crop = pixels[..., top : top + 64, left : left + 64].float()
    assert torch.equal(evaluate(pixels), evaluate.normalize(crop))
    torch.testing.assert_close(evaluate(pixels) * 255, crop, atol=1e-4, rtol=0)


@pytest.mark.parametrize("size", [1, 7, 224])
def test_affine_grid_matches_torch(size):
    theta = torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(size))
    want = F.affine_grid(theta, [5, 3, size, size], align_corners=False)
    torch.testing.assert_close(T.affine_grid(theta, size), want, atol=2e-6, rtol=0)


@pytest.mark.parametrize("flip", [0.0, 1.0])
def test_full_crop_at_model_size_reproduces_pixels(flip):
    train, evaluate = T.build_transforms(aug_args(crop_scale_min=1.0, hflip_prob=flip), 32, MEAN, STD)
    pixels = random_pixels(4, 32, 32)
    expected = evaluate(pixels).flip(-1) if flip else evaluate(pixels)
    torch.testing.assert_close(train(pixels), expected, atol=1e-4, rtol=0)


def test_crop_boxes_follow_random_resized_crop():
    torch.manual_seed(0)
    height, width = 30, 40
    theta = T.sample_crop_flip_theta(4000, height, width, (0.08, 1.0), hflip_prob=0.3)
    scale_x, scale_y, cx, cy = theta[:, 0, 0], theta[:, 1, 1], theta[:, 0, 2], theta[:, 1, 2]
    assert torch.all(theta[:, 0, 1] == 0) and torch.all(theta[:, 1, 0] == 0)
    area = scale_x.abs() * scale_y
    aspect = scale_x.abs() * width / (scale_y * height)
    assert area.min() >= 0.08 - 1e-6 and area.max() <= 1 + 1e-6
    assert aspect.min() >= 3 / 4 - 1e-5 and aspect.max() <= 4 / 3 + 1e-5
    assert torch.all(cx.abs() + scale_x.abs() <= 1 + 1e-5) and torch.all(cy.abs() + scale_y <= 1 + 1e-5)  # inside
    assert 0.26 < (scale_x < 0).float().mean() < 0.34  # flip rate
    assert 0.3 < area.mean() < 0.6  # uniform area in [0.08, 1], minus rejected draws: ~0.45


@pytest.mark.parametrize("height, width", [(10, 100), (100, 10), (40, 40)])
def test_crop_falls_back_to_the_centred_whole_image_trimmed_to_the_ratio(height, width):
    """torchvision's fallback when none of the 10 attempts fits: the whole image, cut to the nearest aspect ratio in
    [3/4, 4/3], centred. Crops of 99-100% of the area of a 10:1 image never fit; a square one does at most aspect 1."""
    theta = T.sample_crop_flip_theta(64, height, width, (0.99, 1.0), hflip_prob=0.0)
    aspect = width / height
    box_w = height * 4 / 3 if aspect > 4 / 3 else width
    box_h = width / (3 / 4) if aspect < 3 / 4 else height
    expected = torch.tensor([[box_w / width, 0, 0], [0, box_h / height, 0]]).expand(64, 2, 3)
    if aspect == 1:  # a fitting attempt: area 99-100%, aspect within 1% of 1, anywhere; the fallback would be exact
        assert torch.all((theta[:, 0, 0] - 1).abs() < 0.02) and not torch.equal(theta, expected)
    else:
        torch.testing.assert_close(theta, expected)


def test_crop_samples_inside_the_box_and_flips():
    """A horizontal ramp stays monotone: increasing, or decreasing when flipped; values stay in the crop's range."""
    ramp = torch.arange(64, dtype=torch.uint8).mul(4).expand(16, 3, 48, 64).contiguous()
    torch.manual_seed(3)
    train, _ = T.build_transforms(aug_args(hflip_prob=0.5), 32, 0.0, 1.0)
    rows = train(ramp)[:, 0, 0, :] * 255
    steps = rows.diff(dim=1)
    increasing, decreasing = (steps >= -1e-3).all(1), (steps <= 1e-3).all(1)
    assert torch.all(increasing | decreasing) and increasing.any() and decreasing.any()
    assert torch.all(rows.amax(1) - rows.amin(1) > 0)


@pytest.mark.parametrize("name, magnitude", [("ShearX", 0.3), ("ShearY", -0.25), ("TranslateX", 7.6),
                                             ("TranslateY", -5.0), ("Rotate", 30.0), ("Rotate", -135.0)])  # fmt: skip
def test_crop_and_warp_is_the_crop_then_the_op_in_one_pass(name, magnitude):
    """On linear ramps bilinear sampling is exact: one pass must equal the crop's pass then the op's wherever the op
    samples inside the crop, and both be black where it samples a pixel or more outside."""
    rows, cols = torch.meshgrid(torch.arange(48.0), torch.arange(64.0), indexing="ij")
    ramps = torch.stack([2 * rows + cols, 200 - 2 * cols, 3 * rows]).expand(2, 3, 48, 64)
    crop = torch.tensor([[[-0.6, 0, 0.2], [0, 0.5, -0.3]], [[0.7, 0, -0.1], [0, 0.8, 0.1]]])  # the first flipped
    m, size = torch.full((2,), magnitude), 32
    warp = T.warp_theta(name, m, size)
    one_pass = T.crop_and_warp(ramps, crop, warp, size).permute(0, 2, 3, 1)
    two_passes = T.OPS[name](T.resample(ramps, crop, size, "border"), m).permute(0, 2, 3, 1)
    at = (T.affine_grid(warp, size) + 1) * size / 2 - 0.5  # where each output pixel samples the crop, in pixels
    inside, outside = ((at >= 0) & (at <= size - 1)).all(-1), ((at <= -1) | (at >= size)).any(-1)
    assert inside.float().mean() > 0.3 and outside.any()
    torch.testing.assert_close(one_pass[inside], two_passes[inside], atol=1e-3, rtol=1e-5)
    assert torch.all(one_pass[outside] == 0) and torch.all(two_passes[outside] == 0)


def test_the_first_rounds_geometric_ops_join_the_crop():
    """TrivialAugment as trained (one pass for crop and warp) against the crop then each sample's op: equal on
    linear ramps wherever neither black fill nor the source's clamped edge is near."""
    rows, cols = torch.meshgrid(torch.arange(40.0), torch.arange(40.0), indexing="ij")
    pixels = torch.stack([3 * rows + 2 * cols, 120 + cols, 2 * rows + 10]).to(torch.uint8).expand(64, 3, 40, 40)
    train, _ = T.build_transforms(aug_args(auto_augment="trivialaugment", crop_scale_min=0.5), 32, 0.0, 1.0)
    out = train(pixels, drawn()) * 255
    rng = drawn()  # the same draws: the crops (device), then the ops (host)
    crop = T.sample_crop_flip_theta(64, 40, 40, (0.5, 1.0), 0.5, generator=rng.device)
    op_ids, magnitudes = train.random_ops.sample(64, rng.host)
    expected = T.apply_per_sample_ops(T.resample(pixels.float(), crop, 32, "border"), op_ids, magnitudes,
                                      train.random_ops.names)  # fmt: skip
    warp, _ = train.random_ops.take_warps(op_ids, magnitudes)
    warped = (warp != torch.eye(2, 3)).flatten(1).any(1)
    assert warped.sum() >= 10 and (~warped).sum() >= 10
    at = T.affine_grid(warp, 32)  # where each output pixel samples the crop
    inside = (((at + 1) * 16 - 0.5 >= 0) & ((at + 1) * 16 - 0.5 <= 31)).all(-1)  # in pixels: no fill involved
    source = (at * crop.diagonal(dim1=1, dim2=2)[:, None, None] + crop[:, None, None, :, 2] + 1) * 20 - 0.5
    unclamped = ((source >= 1.5) & (source <= 37.5)).all(-1)  # in source pixels: clear of its clamped edge
    compare = (inside & unclamped).unsqueeze(1).expand_as(out)
    assert compare[warped].float().mean() > 0.3
    torch.testing.assert_close(out[compare], expected[compare], atol=0.05, rtol=1e-4)


# --------------------------------------------------------------------------------------------------- ops vs PIL


@pytest.fixture(scope="module")
def images():
    """Three 32x32 RGB images: natural-ish, noisy, low contrast."""
    rng = np.random.default_rng(1)
    low_contrast = rng.integers(90, 130, (32, 32, 3), dtype=np.uint8)
    return [smooth_image(32, 32), rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), low_contrast]


def apply_op(name, images, magnitude):
    x = as_float_batch(*images)
    return T.OPS[name](x, torch.full((len(images),), float(magnitude)))


def assert_matches_pil(name, images, magnitude, pil_op, max_diff, mean_diff=0.5):
    out = apply_op(name, images, magnitude)
    for image, result in zip(images, out):
        reference = np.asarray(pil_op(Image.fromarray(image)), dtype=np.float32)
        diff = np.abs(as_hwc(result) - reference)
        assert diff.max() <= max_diff, (name, magnitude, diff.max())
        assert diff.mean() <= mean_diff, (name, magnitude, diff.mean())


@pytest.mark.parametrize("bits", range(1, 9))
def test_posterize_matches_pil(images, bits):
    assert_matches_pil("Posterize", images, bits, lambda im: ImageOps.posterize(im, bits), max_diff=0)


@pytest.mark.parametrize("threshold", [0, 100, 128, 178.5, 255])
def test_solarize_matches_pil(images, threshold):
    assert_matches_pil("Solarize", images, threshold, lambda im: ImageOps.solarize(im, threshold), max_diff=0)


def test_equalize_matches_pil(images):
    rng = np.random.default_rng(2)
    more = [np.full((32, 32, 3), 77, np.uint8), rng.choice([10, 200], (32, 32, 3)).astype(np.uint8)]
    assert_matches_pil("Equalize", images + more, 0, ImageOps.equalize, max_diff=0)


def test_equalize_is_per_image_and_channel():
    """Equalising a batch equals equalising each image alone (histograms must not leak across images/channels)."""
    x = as_float_batch(*(smooth_image(24, 24, seed) for seed in range(5)))
    x[2, 1] = 0.5 * x[2, 1]  # a dim channel
    zero = torch.zeros(1)
    singles = torch.cat([T.equalize(image[None], zero) for image in x])
    assert torch.equal(T.equalize(x, torch.zeros(5)), singles)


def test_autocontrast_matches_pil(images):
    rng = np.random.default_rng(3)
    channels_apart = np.stack([rng.integers(lo, hi, (32, 32)) for lo, hi in ((50, 100), (0, 256), (120, 131))], -1)
    assert_matches_pil("AutoContrast", images + [channels_apart.astype(np.uint8)], 0, ImageOps.autocontrast, 1)
    flat = as_float_batch(np.full((8, 8, 3), 42, np.uint8))
    assert torch.equal(T.autocontrast(flat, torch.zeros(1)), flat)


@pytest.mark.parametrize("magnitude", [-0.9, -0.3, 0.0, 0.5, 0.99])
@pytest.mark.parametrize(
    "name, enhancer, max_diff",
    [
        ("Brightness", ImageEnhance.Brightness, 1),
        ("Color", ImageEnhance.Color, 1.5),  # PIL's grey is uint8, with slightly different weights
        ("Contrast", ImageEnhance.Contrast, 1.5),  # PIL rounds the mean grey to an integer
        ("Sharpness", ImageEnhance.Sharpness, 1.5),  # PIL's smoothed image is uint8
    ],
)
def test_enhance_ops_match_pil(images, name, enhancer, max_diff, magnitude):
    """Ops stay float; PIL truncates each blend to uint8, hence differences up to ~1 level."""

    def pil_op(image):
        return enhancer(image).enhance(1 + magnitude)

    assert_matches_pil(name, images, magnitude, pil_op, max_diff=max_diff, mean_diff=1.0)


@pytest.mark.parametrize("name", ["Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate"])
def test_geometric_ops_at_zero_are_identity(images, name):
    x = as_float_batch(*images)
    torch.testing.assert_close(T.OPS[name](x, torch.zeros(len(images))), x, atol=1e-3, rtol=0)


@pytest.mark.parametrize("shift", [5, -3, 7.9])
def test_translate_shifts_whole_pixels_and_fills_black(images, shift):
    x = as_float_batch(*images)
    k = int(shift)  # torchvision truncates the magnitude
    expected_x, expected_y = torch.zeros_like(x), torch.zeros_like(x)
    if k > 0:
        expected_x[..., k:], expected_y[..., k:, :] = x[..., :-k], x[..., :-k, :]
    else:
        expected_x[..., :k], expected_y[..., :k, :] = x[..., -k:], x[..., -k:, :]
    magnitude = torch.full((len(images),), float(shift))
    torch.testing.assert_close(T.OPS["TranslateX"](x, magnitude), expected_x, atol=1e-3, rtol=0)
    torch.testing.assert_close(T.OPS["TranslateY"](x, magnitude), expected_y, atol=1e-3, rtol=0)


def source_coords(matrix, offset, size=32):
    """Where each output pixel samples the input (pixel-centre coordinates), for an inverse map about the centre."""
    ys, xs = np.mgrid[0:size, 0:size] + 0.5 - size / 2
    sx = matrix[0][0] * xs + matrix[0][1] * ys + offset[0] + size / 2 - 0.5
    sy = matrix[1][0] * xs + matrix[1][1] * ys + offset[1] + size / 2 - 0.5
    return sx, sy


def source_inside(matrix, offset, margin=0.0, size=32):
    """Output pixels sampling within `margin` pixels of the image's pixel centres (0 = no black fill involved)."""
    sx, sy = source_coords(matrix, offset, size)
    lo, hi = -margin, size - 1 + margin
    return (sx >= lo) & (sx <= hi) & (sy >= lo) & (sy <= hi)


@pytest.mark.parametrize("magnitude", [0.3, -0.2, 0.99])
def test_shear_matches_pil_affine(images, magnitude):
    """torchvision shears about the top-left corner: PIL affine data (1, m, 0, 0, 1, 0) / (1, 0, 0, m, 1, 0)."""
    m = magnitude
    cases = [
        ("ShearX", (1, m, 0, 0, 1, 0), [[1, m], [0, 1]], (m * 16, 0)),
        ("ShearY", (1, 0, 0, m, 1, 0), [[1, 0], [m, 1]], (0, m * 16)),
    ]
    for name, data, matrix, offset in cases:
        out = apply_op(name, images, m)
        inside, outside = source_inside(matrix, offset), ~source_inside(matrix, offset, margin=1.0)
        assert inside.mean() > 0.3 and outside.any()
        for image, result in zip(images, out):
            reference = Image.fromarray(image).transform((32, 32), Image.AFFINE, data, resample=Image.BILINEAR)
            diff = np.abs(as_hwc(result) - np.asarray(reference, dtype=np.float32))
            assert diff[inside].max() <= 1.001, (name, m)  # PIL rounds to uint8
            assert np.all(as_hwc(result)[outside] == 0), (name, m)  # torchvision's fill=0


@pytest.mark.parametrize("degrees", [90.0, 30.0, -45.0, 135.0])
def test_rotate_matches_pil_counter_clockwise(images, degrees):
    out = apply_op("Rotate", images, degrees)
    rad = math.radians(degrees)
    inside = source_inside([[math.cos(rad), -math.sin(rad)], [math.sin(rad), math.cos(rad)]], (0, 0))
    for image, result in zip(images, out):
        reference = np.asarray(Image.fromarray(image).rotate(degrees, resample=Image.BILINEAR), dtype=np.float32)
        assert np.abs(as_hwc(result) - reference)[inside].max() <= 1.001, degrees


# --------------------------------------------------------------------------------------------------- policies


def test_magnitude_tables_match_torchvision():
    ra = T.augmentation_space("randaugment", 224)
    assert ra["ShearX"][0][9].item() == pytest.approx(0.09) and ra["ShearX"][1]
    assert ra["TranslateX"][0][9].item() == pytest.approx(150 / 331 * 224 * 0.3, rel=1e-5)
    assert ra["Rotate"][0][9].item() == pytest.approx(9.0)
    assert ra["Brightness"][0][30].item() == pytest.approx(0.9)
    assert ra["Posterize"][0][[0, 9, 30]].tolist() == [8, 7, 4] and not ra["Posterize"][1]
    assert ra["Solarize"][0][9].item() == pytest.approx(255 - 9 * 8.5)
    ta = T.augmentation_space("trivialaugment", 224)
    assert ta["TranslateX"][0][30].item() == pytest.approx(32.0)
    assert ta["Rotate"][0][30].item() == pytest.approx(135.0)
    assert ta["Sharpness"][0][30].item() == pytest.approx(0.99)
    assert ta["Posterize"][0][[0, 30]].tolist() == [8, 2]
    assert list(ra) == list(T.OPS) == list(ta)


def test_per_sample_ops_apply_each_samples_own_op():
    """Every op drawn by two samples with different images and magnitudes: the grouping must keep them apart."""
    x = as_float_batch(*(smooth_image(16, 16, seed) for seed in range(28)))
    names = list(T.OPS)
    op_ids = torch.arange(14).repeat(2)[torch.randperm(28, generator=torch.Generator().manual_seed(0))]
    magnitudes = torch.linspace(-0.5, 0.6, 28)
    magnitudes = torch.where(op_ids == names.index("Posterize"), 2 + (magnitudes > 0).float() * 4, magnitudes)
    magnitudes = torch.where(op_ids == names.index("Solarize"), 128 + magnitudes * 100, magnitudes)
    magnitudes = torch.where(op_ids == names.index("Rotate"), magnitudes * 60, magnitudes)
    is_translate = (op_ids == names.index("TranslateX")) | (op_ids == names.index("TranslateY"))
    magnitudes = torch.where(is_translate, magnitudes * 10, magnitudes)
    out = T.apply_per_sample_ops(x, op_ids, magnitudes, names)
    for i in range(28):
        expected = T.OPS[names[op_ids[i]]](x[i : i + 1], magnitudes[i : i + 1])[0]
        torch.testing.assert_close(out[i], expected)


@pytest.mark.parametrize("policy", ["randaugment", "trivialaugment"])
def test_policies_run_on_a_batch(policy):
    pixels = random_pixels(16, 32, 32)
    plain, _ = T.build_transforms(aug_args(), 64, MEAN, STD)
    augmented, _ = T.build_transforms(aug_args(auto_augment=policy, randaugment_magnitude=15), 64, MEAN, STD)
    torch.manual_seed(0)
    reference = plain(pixels)
    torch.manual_seed(0)  # same crops and flips; the policy then changes most samples
    out = augmented(pixels)
    assert out.shape == (16, 3, 64, 64) and torch.isfinite(out).all()
    changed = (out - reference).abs().amax((1, 2, 3)) > 1e-3
    assert changed.sum() >= 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device syncs: CUDA only (run by the GPU acceptance record)")
@pytest.mark.parametrize("policy", POLICIES)
def test_train_transform_and_mixup_never_sync_the_device(policy):
    """A sync drains the queue of kernels the CPU launched ahead, so the GPU idles at every step: the train transform
    (TrivialAugment's op groups, equalize's histogram) and mixup/cutmix must not read anything back."""
    transform, _ = T.build_transforms(aug_args(auto_augment=policy, random_erasing=0.25), 224, MEAN, STD)
    transform, mixup = transform.cuda(), T.MixupCutmix(0.8, 1.0, 100, 0.1)
    pixels, labels = random_pixels(64, 256, 256).cuda(), torch.arange(64, device="cuda") % 100
    mixup(transform(pixels), labels)  # first calls: lazy CUDA initialisation may sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3):  # several draws: every op of the policy gets its turn; global RNGs, then per batch
            mixup(transform(pixels), labels)
            randomness = drawn(step=step, device="cuda")  # as the trainer draws: a CUDA generator per batch
            mixup(transform(pixels, randomness), labels, randomness)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_train_draws_are_keyed_by_seed_rank_step_and_micro_batch():
    """Every rank augments its batch differently (the Trainer seeds all ranks alike), and the same key draws the same
    augmentation whatever the global RNGs did: a resumed run needs no RNG state to redraw it."""
    train, _ = T.build_transforms(aug_args(auto_augment="trivialaugment", random_erasing=0.5), 32, MEAN, STD)
    pixels = random_pixels(16, 40, 40)
    base = train(pixels, drawn())
    torch.manual_seed(123)
    assert torch.equal(train(pixels, drawn()), base)
    for other in (drawn(seed=1), drawn(rank=1), drawn(step=1), drawn(micro_batch=1)):
        assert ((train(pixels, other) - base).abs().amax((1, 2, 3)) > 1e-3).all()  # every image: its own crop


def test_each_training_batch_gets_the_randomness_of_its_rank_step_and_micro_batch():
    from vit_recipes.data.batches import DeviceBatches

    class Trainer:  # what DeviceBatches reads of the Trainer; its training_step hands back the batch's randomness
        def __init__(self, rank):
            self.args = SimpleNamespace(seed=42, process_index=rank, device=torch.device("cpu"))
            self.state = SimpleNamespace(global_step=0)

        def training_step(self, model, inputs, num_items_in_batch=None):
            return torch.rand(3, generator=self.randomness.host).tolist()

    class Batches(DeviceBatches, Trainer):
        pass

    def draws(rank, first_step=0, steps=2, accumulation=2):
        trainer = Batches(rank)
        out = []
        for step in range(first_step, steps):
            trainer.state.global_step = step
            out += [trainer.training_step(None, {}) for _ in range(accumulation)]
        return out

    run = draws(rank=0)
    assert len({tuple(d) for d in run}) == 4  # each micro-batch of each step its own draws
    assert draws(rank=0, first_step=1) == run[2:]  # resumed at step 1: the same draws, from a fresh trainer
    assert not {tuple(d) for d in draws(rank=1)} & {tuple(d) for d in run}  # rank 1 draws its own


def test_random_ops_sample_ops_uniformly_with_signs():
    torch.manual_seed(0)
    ops = T.RandomOps("randaugment", 64, magnitude=9)
    op_ids, magnitudes = ops.sample(14000)
    counts = torch.bincount(op_ids, minlength=14)
    assert counts.min() > 850 and counts.max() < 1150
    rotate = magnitudes[op_ids == list(T.OPS).index("Rotate")]
    assert set(rotate.tolist()) == {9.0, -9.0}
    ta = T.RandomOps("trivialaugment", 64)
    op_ids, magnitudes = ta.sample(14000)
    posterize_bits = magnitudes[op_ids == list(T.OPS).index("Posterize")]
    assert set(posterize_bits.tolist()) == set(range(2, 9))


# --------------------------------------------------------------------------------------------------- eval vs HF


@pytest.mark.parametrize(
    "height, width, crop_pct",
    [(32, 32, 1.0), (333, 400, 0.875), (256, 300, 0.875)],
    ids=["upsample-32", "downsample-400x333", "crop-only-300x256"],
)
def test_eval_matches_hf_image_processor(height, width, crop_pct, capsys):
    from transformers.models.bit.image_processing_pil_bit import BitImageProcessorPil  # BitImageProcessor's PIL path

    processor = BitImageProcessorPil(
        do_resize=True,
        size={"shortest_edge": round(224 / crop_pct)},
        resample=Image.BICUBIC,
        do_center_crop=True,
        crop_size={"height": 224, "width": 224},
        do_rescale=True,
        do_normalize=True,
        image_mean=MEAN,
        image_std=STD,
        do_convert_rgb=True,
    )
    images = [
        smooth_image(height, width, seed=4),
        np.random.default_rng(5).integers(0, 256, (height, width, 3), dtype=np.uint8),
    ]
    expected = processor([Image.fromarray(image) for image in images], return_tensors="pt")["pixel_values"]
    _, evaluate = T.build_transforms(aug_args(eval_crop_pct=crop_pct), 224, MEAN, STD)
    out = evaluate(torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2))
    diff = (out - expected).abs()
    with capsys.disabled():
        print(f"\neval vs BitImageProcessor {width}x{height}: mean |diff| {diff.mean():.2e}, max {diff.max():.3f}")
    assert out.shape == expected.shape
    assert diff.mean() < 0.05  # the brief's bar; measured ~1e-5
    assert diff.max() < 0.05  # within 2 uint8 levels everywhere


# --------------------------------------------------------------------------------------------------- mixup


def constant_images(batch, size=16):
    """Sample i is filled with value i, so each output pixel tells which sample it came from."""
    return torch.arange(batch, dtype=torch.float32).view(-1, 1, 1, 1).expand(batch, 3, size, size).contiguous()


def test_build_mixup():
    assert T.build_mixup(aug_args(), 10, 0.1) is None
    mix = T.build_mixup(aug_args(mixup_alpha=0.8, cutmix_alpha=1.0), 10, 0.1)
    assert (mix.mixup_alpha, mix.cutmix_alpha, mix.num_classes, mix.label_smoothing) == (0.8, 1.0, 10, 0.1)


def test_mixup_mixes_pixels_and_targets_with_the_same_lam():
    mix = T.MixupCutmix(mixup_alpha=0.8, cutmix_alpha=0.0, num_classes=6)
    pixels, labels = constant_images(6), torch.arange(6)
    out, targets = mix(pixels, labels, drawn())
    assert out.shape == pixels.shape and targets.shape == (6, 6) and targets.dtype == torch.float32
    lam = targets[0, 0].item()
    assert 0 < lam < 1
    torch.testing.assert_close(out, lam * pixels + (1 - lam) * pixels.flip(0))
    torch.testing.assert_close(targets.sum(1), torch.ones(6))


@pytest.mark.parametrize("seed", range(5))
def test_cutmix_lam_is_the_kept_pixel_fraction(seed):
    mix = T.MixupCutmix(mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=4)
    out, targets = mix(constant_images(4, size=20), torch.arange(4), drawn(seed))
    torch.testing.assert_close(targets.sum(1), torch.ones(4))
    for i in range(4):
        own = (out[i] == i).float().mean().item()
        assert set(out[i].unique().tolist()) <= {float(i), float(3 - i)}
        assert targets[i, i].item() == pytest.approx(own, abs=1e-6)
        assert targets[i, 3 - i].item() == pytest.approx(1 - own, abs=1e-6)


def test_label_smoothing_values():
    mix = T.MixupCutmix(mixup_alpha=1.0, cutmix_alpha=1.0, num_classes=10, label_smoothing=0.1)
    same_class = torch.full((4,), 3)  # mixing cannot blur the targets
    _, targets = mix(torch.rand(4, 3, 8, 8), same_class, drawn())
    expected = torch.full((4, 10), 0.01)
    expected[:, 3] = 0.91
    torch.testing.assert_close(targets, expected)


def test_mixup_and_cutmix_are_both_chosen_and_seeded_per_batch():
    mix = T.MixupCutmix(mixup_alpha=1.0, cutmix_alpha=1.0, num_classes=4)
    pixels, labels = constant_images(4, size=8), torch.arange(4)
    runs = [mix(pixels, labels, drawn(step=step)) for step in range(200)]
    cutmix_runs = sum(set(out[0].unique().tolist()) <= {0.0, 3.0} for out, _ in runs)
    assert 60 < cutmix_runs < 140
    again = mix(pixels, labels, drawn(step=0))
    assert torch.equal(again[0], runs[0][0]) and torch.equal(again[1], runs[0][1])
    lams = {float(mix(pixels, labels, drawn(rank=rank))[1][0].max()) for rank in range(4)}
    assert len(lams) == 4  # each rank mixes with its own lam
