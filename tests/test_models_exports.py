"""jaxattn.models' public surface: every family that from_pretrained knows is importable from jaxattn.models.

The list comes from the registry (supported_model_types and each model_type's registered Family), never from a
hand-written list here: a family module that registers a model_type without jaxattn.models exporting its config
and model class fails this test.
"""

import pytest

import jaxattn.models
from jaxattn.models import supported_model_types
from jaxattn.models._pretrained import Family, registered_families


@pytest.mark.parametrize("model_type", supported_model_types())
def test_every_family_exports_its_config_and_model(model_type):
    family = registered_families()[model_type]
    assert isinstance(family, Family), (
        f"{model_type}: registered a bare loader; register a Family (_decoder.loader, moe.loader, or "
        f"@_pretrained.loads(ConfigClass, ModelClass) under @register_family)"
    )
    for cls in (family.config_class, family.model_class):
        assert cls.__name__ in jaxattn.models.__all__, f"{model_type}: jaxattn.models.__all__ lacks {cls.__name__}"
        assert getattr(jaxattn.models, cls.__name__) is cls, f"{model_type}: jaxattn.models.{cls.__name__} is another"


def test_every_name_in_all_exists():
    missing = [name for name in jaxattn.models.__all__ if not hasattr(jaxattn.models, name)]
    assert not missing
    assert len(set(jaxattn.models.__all__)) == len(jaxattn.models.__all__)
