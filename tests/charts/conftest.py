"""Fixtures of the artifact checks; the helpers they use are in chart_tools.py."""

from __future__ import annotations

import jsonschema
import pytest
from chart_tools import crd_validator, load_crd


@pytest.fixture(scope="session")
def crd() -> dict:
    """The InferenceService CRD from the chart's crds/ folder."""
    return load_crd()


@pytest.fixture(scope="session")
def isvc_validator(crd: dict) -> jsonschema.protocols.Validator:
    """Validates an InferenceService object against the CRD's openAPIV3Schema."""
    return crd_validator(crd)
