"""Field types and rules every section of the platform config uses: names, images, retentions."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

from typed_config import FieldProblem


# Retention periods CloudWatch Logs accepts (and CDK's RetentionDays names).
LOG_RETENTION_DAYS = (
    1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653
)


def _log_retention(days: int) -> int:
    if days not in LOG_RETENTION_DAYS:
        raise FieldProblem("", days, ", ".join(map(str, LOG_RETENTION_DAYS)), "not a CloudWatch Logs retention")
    return days


RetentionDays = Annotated[int, AfterValidator(_log_retention)]


Name = Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,19}$")]


# A container image as the platform's pods name it: a registry host, then repository path
# components, then a tag or a digest. Path components are lowercase letters and digits joined by
# ".", "_", "__" or dashes; only the host and the tag may have capitals (the reference grammar:
# distribution/reference regexp.go, v0.6.0). Kubernetes passes an image name with capitals to the
# runtime, whose pull fails: the job would wait in ErrImagePull. Never :latest.
IMAGE_PATTERN = re.compile(r"^[A-Za-z0-9.-]+(:\d+)?(/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)+"
                           r"(:[\w][\w.-]{0,127}|@sha256:[0-9a-f]{64})$")
IMAGE_HELP = ("an image pinned by tag or digest, its repository in lowercase, "
              "e.g. 123456789012.dkr.ecr.us-west-2.amazonaws.com/trainer:gpu-0.1.0 (not :latest)")


def pinned_image(value: str) -> bool:
    return bool(IMAGE_PATTERN.match(value)) and not value.endswith(":latest")


SemVer = Annotated[str, Field(pattern=r"^v?\d+\.\d+\.\d+$")]


# A Kubernetes object name (RFC 1123 label), for the config and the job spec alike.
K8S_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
K8S_NAME_HELP = "a Kubernetes name: lowercase letters, digits and '-', at most 63"
K8sName = Annotated[str, Field(pattern=K8S_NAME_PATTERN)]


AccountId = Annotated[str, Field(pattern=r"^\d{12}$")]
RegionName = Annotated[str, Field(pattern=r"^[a-z]{2}(-[a-z]+)+-\d$")]
