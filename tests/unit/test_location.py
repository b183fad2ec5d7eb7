"""storage.fs.Location: what a URI's filesystem is built with, beyond what the URI says."""

import pytest

from storage.fs import GCS_RETRY_LIMIT_S, Location


def retry_seconds(location: Location) -> float:
    options = location.fs.__reduce__()[1][0]  # how pyarrow pickles a GcsFileSystem: its options
    return options["retry_time_limit"].total_seconds()


@pytest.mark.parametrize("uri", ["gs://bucket/data", "gs://bucket/data?scheme=http"])
def test_a_gcs_location_retries_for_seconds_not_pyarrows_fifteen_minutes(uri):
    """Without a network or credentials, pyarrow's default kept `fit` silent for 18 minutes."""
    location = Location.parse(uri)
    assert retry_seconds(location) == GCS_RETRY_LIMIT_S
    assert str(location) == uri  # printed, saved in plan.json and joined as the user wrote it
    assert retry_seconds(location / "shard-0") == GCS_RETRY_LIMIT_S


def test_a_gcs_uri_that_sets_its_own_retry_limit_keeps_it():
    assert retry_seconds(Location.parse("gs://bucket/data?retry_limit_seconds=300")) == 300
