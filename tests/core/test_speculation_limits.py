"""adaptive_num_speculative_tokens, hand-worked: a request drafts one token more than its last
verification accepted, one more again after each verification that accepted all, never above k."""

from cbjax.core.request import Request, RequestStatus
from cbjax.core.spec.config import SpeculativeConfig
from cbjax.core.spec.speculation import Speculation
from cbjax.sampling_params import SamplingParams


class FourDrafts:
    k = 4

    def draft(self, requests):
        return [[7, 8, 9, 10] for _ in requests]

    def finish(self, request):
        pass


def running_request() -> Request:
    request = Request("a", [1, 2, 3], SamplingParams(temperature=0.0), [2])
    request.status = RequestStatus.RUNNING
    return request


def drafted(speculation: Speculation, request: Request) -> int:
    speculation.propose([request])
    return len(request.spec_token_ids)


def test_a_requests_drafts_shrink_after_a_miss_and_grow_back_after_full_acceptance():
    config = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 4, "adaptive_num_speculative_tokens": True})
    speculation = Speculation(config, FourDrafts())
    request = running_request()
    assert drafted(speculation, request) == 4
    lengths = []
    for num_draft, num_accepted in [(4, 1), (2, 2), (3, 3), (4, 4), (4, 4), (4, 0)]:
        speculation.record("a", num_draft, num_accepted)
        lengths.append(drafted(speculation, request))
    assert lengths == [2, 3, 4, 4, 4, 1]
    speculation.finish(request)  # a finished request's limit is forgotten
    assert speculation.draft_limits == {}


def test_without_adaptation_every_verification_drafts_k():
    config = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 4})  # the default: off
    speculation, request = Speculation(config, FourDrafts()), running_request()
    speculation.record("a", 4, 0)
    assert drafted(speculation, request) == 4
