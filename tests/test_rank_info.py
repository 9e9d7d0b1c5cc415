"""RankInfo serialization and the peer-registration checks (pure Python: no Ray, no NIXL)."""

import base64
import json

import pytest

from kv.pool import KVPool
from kv.rank_info import RANK_INFO_VERSION, PeerMismatchError, RankInfo, check_peer, describe_pools
from kv.spec import LayerOwner, make_layer_specs


def rank_info(num_draft_layers=1, target_dtype="fp8", draft_dtype="bf16", page_size=16, kv_heads=2,
              num_target_layers=2, unified=True, tp_size=1, tp_rank=0) -> RankInfo:
    target = make_layer_specs(LayerOwner.TARGET, num_target_layers, target_dtype, kv_heads, 16)
    draft = make_layer_specs(LayerOwner.DRAFT, num_draft_layers, draft_dtype, kv_heads, 16)
    spaces = [target + draft] if unified or not draft else [target, draft]
    pools = [KVPool(specs, page_size, 4) for specs in spaces]
    return describe_pools(pools, tp_size=tp_size, tp_rank=tp_rank, agent_name=f"peer-{num_draft_layers}",
                          agent_metadata=b"\x00\xffagent")


def test_round_trip_keeps_every_field():
    info = rank_info(tp_size=2, tp_rank=1)
    again = RankInfo.from_json(info.to_json())
    assert again == info
    assert json.loads(info.to_json())["version"] == RANK_INFO_VERSION
    assert json.loads(info.to_json())["agent_metadata"] == base64.b64encode(b"\x00\xffagent").decode()


def test_fp8_target_keeps_two_byte_draft_layers():
    info = rank_info(target_dtype="fp8", draft_dtype="bf16")
    sizes = {layer.name: layer.element_size for layer in info.layers}
    assert sizes == {"target.0": 1, "target.1": 1, "draft.0": 2}
    assert (info.num_target_layers, info.num_draft_layers) == (2, 1)


def test_old_payload_without_draft_fields_reads_as_zero_draft_layers():
    v1 = {"version": 1, "tp_size": 1, "tp_rank": 0, "page_size": 16, "agent_name": "old",
          "agent_metadata": base64.b64encode(b"meta").decode(),
          "layers": [{"layer_index": i, "dtype": "bfloat16", "element_size": 2, "num_kv_heads": 2, "head_dim": 16}
                     for i in range(2)]}
    info = RankInfo.from_json(json.dumps(v1))
    assert info.num_draft_layers == 0
    assert info.num_target_layers == 2
    assert info.agent_metadata == b"meta"


def test_payload_is_parsed_never_unpickled():
    import pickle
    with pytest.raises(ValueError, match="not JSON"):
        RankInfo.from_json(pickle.dumps({"version": 2}))
    with pytest.raises(ValueError, match="version 99"):
        RankInfo.from_json(json.dumps({"version": 99}))
    with pytest.raises(ValueError, match="malformed"):
        RankInfo.from_json(json.dumps({"version": 2, "tp_size": 1}))


def test_counts_must_agree_with_the_layer_list():
    payload = json.loads(rank_info(num_draft_layers=1).to_json())
    payload["num_draft_layers"] = 2
    with pytest.raises(ValueError, match="2 target and 1 draft layers but says 2 and 2"):
        RankInfo.from_json(json.dumps(payload))


@pytest.mark.parametrize("mine,theirs", [(0, 1), (1, 0), (1, 2), (2, 1)])
def test_draft_layer_count_mismatch_is_refused_naming_both(mine, theirs):
    with pytest.raises(PeerMismatchError, match=f"number of draft layers differs \\(this rank {mine}, peer {theirs}\\)"):
        check_peer(rank_info(num_draft_layers=mine), rank_info(num_draft_layers=theirs))


@pytest.mark.parametrize("field,mine,theirs,message", [
    ("page_size", 16, 8, "page size differs (this rank 16, peer 8)"),
    ("num_target_layers", 2, 3, "number of target layers differs (this rank 2, peer 3)"),
    ("kv_heads", 2, 1, "layer target.0 num kv heads differs (this rank 2, peer 1)"),
    ("tp_size", 1, 2, "tensor-parallel size differs (this rank 1, peer 2)"),
])
def test_geometry_mismatch_is_refused_naming_both(field, mine, theirs, message):
    local, peer = rank_info(**{field: mine}), rank_info(**{field: theirs})
    with pytest.raises(PeerMismatchError) as e:
        check_peer(local, peer)
    assert message in str(e.value)


def test_layer_dtype_and_element_size_mismatch_is_refused():
    with pytest.raises(PeerMismatchError, match=r"target.0 dtype differs \(this rank float8_e4m3fn, peer bfloat16\)"):
        check_peer(rank_info(target_dtype="fp8"), rank_info(target_dtype="bf16"))
    # Same element size, different dtype: still refused (the bytes would be reinterpreted).
    with pytest.raises(PeerMismatchError, match=r"draft.0 dtype differs \(this rank bfloat16, peer float16\)"):
        check_peer(rank_info(draft_dtype="bf16"), rank_info(draft_dtype="fp16"))
    with pytest.raises(PeerMismatchError, match=r"draft.0 dtype differs \(this rank bfloat16, peer float32\)"):
        check_peer(rank_info(draft_dtype="bf16"), rank_info(draft_dtype="fp32"))


def test_unified_and_separate_pools_do_not_exchange_pages():
    with pytest.raises(PeerMismatchError, match="page layout"):
        check_peer(rank_info(target_dtype="bf16", unified=True), rank_info(target_dtype="bf16", unified=False))


@pytest.mark.parametrize("num_draft_layers", [0, 1, 2])
def test_matching_peer_registers(num_draft_layers):
    check_peer(rank_info(num_draft_layers=num_draft_layers), rank_info(num_draft_layers=num_draft_layers))
    # Another process maps its pool elsewhere: addresses may differ, the layout may not.
    check_peer(rank_info(), RankInfo.from_json(rank_info().to_json()))


def test_a_payload_before_page_layouts_reads_as_token_major_and_is_refused():
    """Version 3 peers lay a page out token-major: its head slices sit elsewhere, so the bytes would be wrong."""
    mine = rank_info()
    assert mine.page_layout == "head_major"
    payload = json.loads(mine.to_json())
    del payload["page_layout"]
    payload["version"] = 3
    old = RankInfo.from_json(json.dumps(payload))
    assert old.page_layout == "token_major"
    with pytest.raises(PeerMismatchError, match="order of the bytes in a page differs .*head_major.*token_major"):
        check_peer(mine, old)
    with pytest.raises(ValueError, match="page_layout"):
        RankInfo.from_json(json.dumps({**json.loads(mine.to_json()), "page_layout": "diagonal"}))
