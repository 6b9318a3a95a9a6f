"""kiln prepare from s3:// URLs, against a local S3-compatible server (moto) this test starts."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.data.prepare import PrepareOptions, prepare
from kiln.data.shards import ShardSet
from kiln.data.tokenizer import describe, train_bpe
from kiln.errors import KilnError

moto_server = pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

SECRET = "kiln-test-secret-never-saved"


@pytest.fixture
def s3(monkeypatch):
    # Port 0: the OS picks a free loopback port; the server is stopped when the test ends.
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    options = {"endpoint_url": f"http://{host}:{port}", "key": "kiln-test-key", "secret": SECRET}
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    fs.mkdir("corpus")
    try:
        yield fs, options
    finally:
        server.stop()


def test_s3_jsonl_and_parquet_inputs_match_the_same_files_read_locally(s3, tmp_path):
    fs, options = s3
    tok = describe(train_bpe(["alpha beta gamma delta " * 20], 280))
    docs = [f"alpha beta {'gamma ' * i}delta" for i in range(30)]
    local = tmp_path / "local"
    local.mkdir()
    (local / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:20]))
    pq.write_table(pa.table({"text": docs[20:]}), local / "b.parquet")
    fs.put(str(local / "a.jsonl"), "corpus/web/a.jsonl")
    fs.put(str(local / "b.parquet"), "corpus/web/b.parquet")

    opts = PrepareOptions(progress=False, workers=1, storage_options=options)
    remote = prepare(["s3://corpus/web/*.jsonl", "s3://corpus/web/b.parquet"], tok,
                     tmp_path / "from_s3", opts)
    prepare([str(local / "a.jsonl"), str(local / "b.parquet")], tok, tmp_path / "from_disk",
            PrepareOptions(progress=False, workers=1))
    got, want = ShardSet(tmp_path / "from_s3"), ShardSet(tmp_path / "from_disk")
    np.testing.assert_array_equal(got.read(0, got.total_tokens), want.read(0, want.total_tokens))
    assert remote.manifest["inputs"][0][0] == "s3://corpus/web/a.jsonl"
    assert SECRET not in (tmp_path / "from_s3" / "manifest.json").read_text()
    assert prepare(["s3://corpus/web/*.jsonl", "s3://corpus/web/b.parquet"], tok,
                   tmp_path / "from_s3", opts).reused

    with pytest.raises(KilnError, match="s3://corpus/web/missing.jsonl does not exist"):
        prepare(["s3://corpus/web/missing.jsonl"], tok, tmp_path / "x", opts)
