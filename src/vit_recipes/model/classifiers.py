"""Which transformers class classifies images for a config: what the script builds, sizes and counts FLOPs of."""


def classifier_class(config):
    """The image-classification class transformers builds for `config` (KeyError when none). Of several (DeiT: with
    and without distillation head), the one the config names, else the first, the plain classifier."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING

    found = MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING[type(config)]
    if not isinstance(found, (list, tuple)):
        return found
    named = [c for c in found if c.__name__ in (getattr(config, "architectures", None) or [])]
    return (named or list(found))[0]
