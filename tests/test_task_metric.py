import json

from nb_helpers.task_metric import EXACT_METRIC, JSON_METRIC, metric_name, score

GOLD = json.dumps({"customer": "Ravi", "item": "jacket", "quantity": 9, "color": "yellow", "city": "Tunis",
                   "day": "Tuesday"})


def test_perfect_partial_and_broken_answers():
    assert score(GOLD, GOLD) == 1.0
    half = json.dumps({"customer": "Ravi", "item": "jackets", "quantity": "9", "color": "blue", "city": "Tunis"})
    assert score(half, GOLD) == 3 / 6  # customer, quantity ("9" == 9), city
    assert score("Sure! Here it is: " + GOLD + " Hope that helps.", GOLD) == 1.0  # prose around JSON is tolerated
    assert score('{"customer": "Ravi", ', GOLD) == 0.0  # unparseable
    assert score("no json at all", GOLD) == 0.0
    nested = json.dumps({"customer": {"item": {"quantity": 9}}})
    assert score(nested, GOLD) == 0.0


def test_non_json_references_use_exact_match():
    assert metric_name("Paris") == EXACT_METRIC and metric_name(GOLD) == JSON_METRIC
    assert score("  paris ", "Paris") == 1.0 and score("Lyon", "Paris") == 0.0
