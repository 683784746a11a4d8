"""The shared-secret rules of lighthouse.auth: loading the secret and judging a call."""

from __future__ import annotations

import os

import pytest

from lighthouse.rpc import auth

S = "0123456789abcdef"


@pytest.mark.parametrize(
    "presented, secret, refused, text",
    [
        (None, None, False, ""),
        ("Bearer anything", None, False, ""),
        (f"Bearer {S}", S, False, ""),
        (None, S, True, "carried none"),
        ("", S, True, "carried none"),
        (S, S, True, "carried none"),  # no scheme: not a bearer token
        (f"Basic {S}", S, True, "carried none"),
        ("Bearer wrong", S, True, "carried a wrong one"),
        (f"Bearer {S}x", S, True, "carried a wrong one"),
        (f"Bearer {S[:-1]}", S, True, "carried a wrong one"),
        ("Bearer ", S, True, "carried a wrong one"),
    ],
)
def test_a_call_passes_only_with_the_exact_secret_as_a_bearer_token(
    presented, secret, refused, text
):
    why = auth.refusal(presented, secret, "lighthouse")
    assert (why is not None) == refused
    if refused:
        assert text in why
        assert "this lighthouse requires the job's shared secret" in why
        assert auth.SECRET_FILE_ENV in why and auth.SECRET_ENV in why
        assert S not in why  # the refusal never echoes the secret


def test_the_http_header_helper_passes_the_http_check():
    headers = auth.http_headers(S)
    assert auth.http_refusal(headers, S, "checkpoint server") is None
    assert auth.http_headers(None) == {}
    assert "carried none" in auth.http_refusal({}, S, "checkpoint server")


@pytest.mark.parametrize(
    "environ, secret",
    [
        ({}, None),
        ({auth.SECRET_ENV: S}, S),
        ({auth.SECRET_FILE_ENV: "FILE"}, "from-file-secret"),
    ],
)
def test_the_secret_comes_from_the_environment_or_is_off(tmp_path, environ, secret):
    path = tmp_path / "secret"
    path.write_text("from-file-secret\n")
    environ = {k: str(path) if v == "FILE" else v for k, v in environ.items()}
    assert auth.secret_from_env(environ) == secret


def test_the_secret_file_flag_wins_over_the_environment(tmp_path):
    path = tmp_path / "secret"
    path.write_text("  from-flag  \n")
    environ = {auth.SECRET_ENV: S}
    assert auth.secret_from_env(environ, secret_file=str(path)) == "from-flag"


@pytest.mark.parametrize(
    "environ, message",
    [
        ({auth.SECRET_ENV: ""}, "the secret in TORCHFT_SECRET is empty"),
        ({auth.SECRET_ENV: "two words"}, "holds a space, a control or a non-ASCII character"),
        ({auth.SECRET_ENV: "caf\u00e9"}, "holds a space, a control or a non-ASCII character"),
        ({auth.SECRET_FILE_ENV: ""}, "TORCHFT_SECRET_FILE is set but empty"),
        ({auth.SECRET_FILE_ENV: "/x", auth.SECRET_ENV: S}, "both TORCHFT_SECRET_FILE and"),
        ({auth.SECRET_FILE_ENV: "/no/such/file"}, "cannot read the secret file '/no/such/file'"),
    ],
)
def test_a_bad_secret_setting_is_a_clear_error(environ, message):
    with pytest.raises(ValueError) as e:
        auth.secret_from_env(environ)
    assert message in str(e.value)


def test_an_empty_secret_file_is_a_clear_error(tmp_path):
    path = tmp_path / "secret"
    path.write_text("\n")
    with pytest.raises(ValueError) as e:
        auth.read_secret_file(str(path))
    assert f"the secret in file {str(path)!r} is empty" in str(e.value)
    assert "openssl rand -hex 32" in str(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_secret_file_is_a_clear_error(tmp_path):
    path = tmp_path / "secret"
    path.write_text(S)
    path.chmod(0)
    with pytest.raises(ValueError) as e:
        auth.read_secret_file(str(path))
    assert f"cannot read the secret file {str(path)!r}: Permission denied" in str(e.value)


def test_a_directory_as_secret_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError) as e:
        auth.read_secret_file(str(tmp_path))
    assert f"cannot read the secret file {str(tmp_path)!r}: Is a directory" in str(e.value)


def test_a_secret_file_that_is_not_ascii_text_is_a_clear_error(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"\xff\xfe binary")
    with pytest.raises(ValueError) as e:
        auth.read_secret_file(str(path))
    assert f"cannot read the secret file {str(path)!r}: 'ascii' codec can't decode" in str(e.value)


# ---- a secret per job ----------------------------------------------------------

SECRETS = auth.Secrets("global", {"a": "sa", "b": "sb"})


@pytest.mark.parametrize(
    "presented, job, allowed, names",
    [
        ("Bearer sa", "a", True, None),
        ("Bearer sb", "a", False, "job 'a'"),  # b's secret is refused in a
        ("Bearer global", "a", False, "job 'a'"),  # so is the lighthouse's
        (None, "a", False, "job 'a'"),
        ("Bearer global", None, True, None),  # the default job takes the lighthouse's
        ("Bearer global", "c", True, None),  # so does a job without its own
        ("Bearer sa", "c", False, "lighthouse"),
        ("Bearer sa", None, False, "lighthouse"),
    ],
)
def test_a_job_with_its_own_secret_takes_only_that_one(presented, job, allowed, names):
    why = SECRETS.refusal(presented, job, "lighthouse")
    assert (why is None) == allowed
    if names is not None:
        assert names in why


def test_a_lighthouse_without_a_secret_still_guards_the_jobs_that_have_one():
    secrets = auth.Secrets.of(auth.Secrets(None, {"a": "sa"}))
    assert secrets is not None
    assert secrets.refusal(None, "c", "lighthouse") is None
    assert secrets.refusal(None, None, "lighthouse") is None
    assert "job 'a'" in secrets.refusal(None, "a", "lighthouse")
    assert auth.Secrets.of(auth.Secrets(None, {})) is None
    assert auth.Secrets.of(None) is None


def test_the_metadata_names_the_job_unless_it_is_the_default():
    assert auth.metadata(None, "default") == ()
    assert auth.metadata(None, None) == ()
    assert auth.metadata("s", "a") == (("authorization", "Bearer s"), ("torchft-job", "a"))
