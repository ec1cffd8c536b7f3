"""Installing rlsdk enables its pytest plugin; naming it here as well keeps it on where entry points are off."""

pytest_plugins = ["rlsdk.testing.plugin"]
