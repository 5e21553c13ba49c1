"""Remote URLs, keys and settings (tierkv.tiers.remote.url, .config): in-process, no server."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tierkv
from tests.helpers import REPO
from tierkv.core.errors import BadRequest
from tierkv.core.keys import MAX_KEY_BYTES, Namespace
from tierkv.tiers.remote import RemoteConfig, parse_remote_url, redact_url, remote_key

FP = Namespace("url-model", tierkv.Layout(2, 2, 32, 16, "bfloat16")).fingerprint


@pytest.mark.parametrize(("url", "cluster", "want"), [
    ("redis://127.0.0.1:6380/2", False, {"host": "127.0.0.1", "port": 6380, "db": 2}),
    ("redis://u:pw@h:1/0", False, {"username": "u", "password": "pw", "db": 0}),
    ("redis://h", False, {"host": "h"}),
    ("unix:///run/redis.sock?db=3", False, {"path": "/run/redis.sock", "db": 3}),
    ("rediss://h:7000/0?ssl_cert_reqs=required&ssl_ca_certs=/ca.crt", False, {"ssl_ca_certs": "/ca.crt"}),
    ("REDIS://h:1", False, {"host": "h", "port": 1}),
])
def test_standalone_urls(url, cluster, want):
    t = parse_remote_url(url, cluster=cluster)
    assert not t.cluster and t.seeds == ()
    for k, v in want.items():
        assert t.options[k] == v, (k, t.options)


@pytest.mark.parametrize(("url", "seeds"), [
    ("redis+cluster://a:7000,b:7001,[::1]:7002", (("a", 7000), ("b", 7001), ("::1", 7002))),
    ("rediss+cluster://:pw@a:1", (("a", 1),)),
    ("redis+cluster://a:7000/0", (("a", 7000),)),
])
def test_cluster_urls(url, seeds):
    t = parse_remote_url(url)
    assert t.cluster and t.seeds == seeds
    assert not {"host", "port", "db"} & set(t.options)


def test_plain_url_as_cluster_seed():
    t = parse_remote_url("redis://u:pw@a:7000", cluster=True)
    assert t.cluster and t.seeds == (("a", 7000),) and t.options["password"] == "pw"


@pytest.mark.parametrize(("url", "cluster", "says"), [
    ("", False, "must look like"),
    ("a:1", False, "must look like"),
    (None, False, "must look like"),
    ("http://a:1", False, "scheme 'http'"),
    ("redis+cluster://", False, "at least one host:port"),
    ("redis+cluster://a:7000/3", False, "only database 0"),
    ("redis+cluster://a:b", False, "must be host:port"),
    ("redis+cluster://a:0", False, "must be host:port"),
    ("redis+cluster://a", False, "must be host:port"),
    ("redis://h:abc", False, "Port"),
    ("redis://h:99999", False, "Port"),
    ("redis://h:1/x", False, "database must be a number"),
    ("redis://", False, "no host"),
    ("redis://[::1", False, "IPv6"),
    ("unix://", False, "socket path"),
    ("unix:///x.sock", True, "Unix socket"),
    ("redis://h:1/2", True, "only database 0"),
    ("redis://h:1?socket_timeout=x", False, "socket_timeout"),
])
def test_bad_urls_say_why(url, cluster, says):
    with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("(", r"\(")):
        parse_remote_url(url, cluster=cluster)


@pytest.mark.parametrize("url", ["redis://u:s3cret@h:abc", "redis://:s3cret@h:1/x", "rediss://u:s3cret@/0"])
def test_errors_never_show_the_password(url):
    with pytest.raises(ValueError) as info:
        parse_remote_url(url)
    assert "s3cret" not in str(info.value)


def test_redact():
    assert redact_url("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    assert "secret" not in redact_url("redis+cluster://:secret@a:1,b:2")
    assert redact_url("redis://[::1") == "<unparsable url>"


def test_keys():
    assert remote_key(FP, b"\x01\xff") == b"tierkv:" + FP.hex().encode() + b":01ff"
    assert remote_key(FP, b"k", b"fleet:").startswith(b"fleet:")
    for fp, key in ((FP[:8], b"k"), (FP, b""), (FP, b"k" * (MAX_KEY_BYTES + 1)), (FP.hex(), b"k"), (FP, "k")):
        with pytest.raises(BadRequest):
            remote_key(fp, key)  # type: ignore[arg-type]


def test_config_validation():
    RemoteConfig().validate()  # no URL: no remote tier
    RemoteConfig(url="redis+cluster://a:1,b:2").validate(["lossless"])
    bad = [dict(url="ftp://x"), dict(admission="sometimes"), dict(codec=""), dict(socket_timeout_s=0),
           dict(backoff_s=-1), dict(ttl_s=-1), dict(max_batch=0), dict(batch_bytes=0)]
    for kw in bad:
        with pytest.raises(ValueError):
            RemoteConfig(**kw).validate()
    with pytest.raises(ValueError, match="remote.codec: unknown codec 'nope'"):
        RemoteConfig(codec="nope").validate(["lossless", "int8"])


def test_settings_load_without_redis():
    code = ("import sys, tierkv.daemon.config, tierkv.tiers.remote as r; r.parse_remote_url; "
            "print(sorted(m for m in ('redis', 'tierkv.codecs', 'tierkv.cache') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out
