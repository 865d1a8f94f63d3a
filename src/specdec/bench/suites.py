"""Prompt suites: named lists of (category, prompt) for the chat template.

input-grounded: the answer repeats much of its input (code edits, summaries,
    extraction), where n-gram drafting (prompt lookup, LLMA) shines;
free: open generation, where only a model can guess the next tokens;
code: write-a-function prompts, where a same-family draft model agrees with
    the target most often (the native runner's benchmark).
"""

from __future__ import annotations

_INVENTORY = '''\
def summarize_inventory(data, threshold):
    totals = {}
    for item in data:
        name = item["name"]
        qty = item["quantity"]
        price = item["price"]
        if name not in totals:
            totals[name] = {"quantity": 0, "value": 0.0}
        totals[name]["quantity"] += qty
        totals[name]["value"] += qty * price
    low_stock = []
    for name, info in totals.items():
        if info["quantity"] < threshold:
            low_stock.append(name)
    total_value = sum(info["value"] for info in totals.values())
    return {"totals": totals, "low_stock": sorted(low_stock), "total_value": total_value}
'''

_MOVING_AVERAGE = '''\
def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    running = 0.0
    for index, value in enumerate(values):
        running += value
        if index >= window:
            running -= values[index - window]
        if index >= window - 1:
            averages.append(running / window)
    return averages


def normalize(values):
    lowest = min(values)
    highest = max(values)
    span = highest - lowest
    if span == 0:
        return [0.0 for _ in values]
    return [(value - lowest) / span for value in values]
'''

_REPORT = '''\
def format_report(user, orders):
    lines = []
    lines.append("Report for %s (%s)" % (user.name, user.email))
    lines.append("Member since: {}".format(user.joined.strftime("%Y-%m-%d")))
    total = 0
    for order in orders:
        lines.append("  Order %d: %d items, %.2f EUR" % (order.id, len(order.items), order.amount))
        total += order.amount
    lines.append("Total spent: {:.2f} EUR".format(total))
    lines.append("Average order: %.2f EUR" % (total / len(orders) if orders else 0))
    return "\\n".join(lines)
'''

_PAGINATE = '''\
def paginate(items, page_size):
    pages = []
    for start in range(0, len(items) - 1, page_size):
        pages.append(items[start:start + page_size])
    return pages


def page_count(items, page_size):
    return len(paginate(items, page_size))
'''

_ACCOUNT = '''\
class Account:
    def __init__(self, owner, balance=0):
        self.owner = owner
        self.balance = balance
        self.history = []

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount
        self.history.append(("deposit", amount))

    def withdraw(self, amount):
        if amount > self.balance:
            raise ValueError("insufficient funds")
        self.balance -= amount
        self.history.append(("withdraw", amount))

    def calc(self):
        return sum(amount if kind == "deposit" else -amount for kind, amount in self.history)
'''

_TIDES = (
    "Tides are the regular rise and fall of the sea surface, caused mainly by the gravitational pull of the "
    "Moon and, to a lesser degree, the Sun. Because the Moon pulls hardest on the side of the Earth facing it, "
    "the ocean there bulges toward the Moon; on the opposite side, the Earth itself is pulled away from the "
    "water, producing a second bulge. As the Earth rotates through these two bulges, most coastlines see two "
    "high tides and two low tides roughly every 24 hours and 50 minutes. When the Sun, Moon and Earth line up, "
    "at new moon and full moon, their pulls combine to produce spring tides, with higher highs and lower lows. "
    "When the Sun and Moon are at right angles, at the quarter moons, their pulls partly cancel and produce "
    "neap tides, with a smaller range. The shape of coastlines and the depth of the sea floor strongly modify "
    "tides: the Bay of Fundy in Canada has a tidal range of up to 16 metres, while parts of the Mediterranean "
    "barely notice the tide at all."
)

_MEETING = (
    "Notes from the project meeting on 14 March 2024. Present: Alice Moreau (product), Bob Nakamura "
    "(engineering), Carla Diaz (design) and David Okafor (QA). Alice reported that the beta release slipped "
    "from 1 April to 15 April because the payment provider changed its API. Bob will update the payment "
    "client by 22 March and asked David to prepare regression tests for checkout by 27 March. Carla presented "
    "the new onboarding screens; the team agreed to ship them with the beta, and Carla will hand over the "
    "final assets to Bob by 20 March. David raised that the Android build fails on devices older than "
    "Android 10; Bob will investigate and report back at the next meeting on 21 March. Alice will inform the "
    "marketing team about the new beta date by 15 March."
)

_SUPPORT_DOC = (
    "Returns and refunds. You can return most items within 30 days of delivery for a full refund. Items must "
    "be unused and in their original packaging. Electronics can be returned within 14 days and must include "
    "all accessories. Personalised items, gift cards and perishable goods cannot be returned. To start a "
    "return, open your order in the account page and choose 'Return an item'; you will receive a prepaid "
    "shipping label by email within one business day. Refunds are issued to the original payment method "
    "within 5 to 7 business days after we receive the item. If you paid with a gift card, the refund is "
    "added to a new gift card. Shipping costs are refunded only if the item arrived damaged or was not what "
    "you ordered. For damaged items, please send a photo to support@example.com within 48 hours of delivery."
)

_CONFIG_TEXT = (
    "Server configuration for the staging cluster: the web service listens on port 8080 and runs 4 worker "
    "processes with a request timeout of 30 seconds. The database is PostgreSQL 15 on host db.staging.local, "
    "port 5432, with a connection pool of 20. The cache is Redis 7 on host cache.staging.local, port 6379, "
    "with a default TTL of 300 seconds. Logs are written at level INFO to /var/log/app/staging.log and "
    "rotated daily, keeping 14 files. The metrics exporter listens on port 9100."
)

SUITES: dict[str, list[tuple[str, str]]] = {
    "input-grounded": [
        ("code-edit", "Rename the variable `data` to `records` everywhere in this function. "
                      "Reply with the whole updated function only.\n\n```python\n" + _INVENTORY + "```"),
        ("code-edit", "Add Python type hints to every function in this code (use list[float] and int). "
                      "Do not change anything else. Reply with the whole code only.\n\n```python\n"
                      + _MOVING_AVERAGE + "```"),
        ("code-edit", "Rewrite this function to use f-strings instead of % formatting and str.format. "
                      "Keep everything else the same. Reply with the whole function only.\n\n```python\n"
                      + _REPORT + "```"),
        ("code-edit", "There is an off-by-one bug in `paginate`: the last item can be lost. Fix it and "
                      "reply with the whole corrected code only.\n\n```python\n" + _PAGINATE + "```"),
        ("code-edit", "Rename the method `calc` to `net_flow` in this class. Reply with the whole class "
                      "only.\n\n```python\n" + _ACCOUNT + "```"),
        ("extract", "Summarise the following text in three sentences, reusing its wording where you can.\n\n"
                    + _TIDES),
        ("extract", "List every action item from these meeting notes as a bullet: who, what, and by when.\n\n"
                    + _MEETING),
        ("extract", "Using only the policy below, answer: can I return headphones I bought 20 days ago, and how "
                    "will I get my money back? Quote the sentences you rely on.\n\n" + _SUPPORT_DOC),
        ("extract", "Extract every setting from this text as a YAML document with sections web, database, "
                    "cache, logging and metrics.\n\n" + _CONFIG_TEXT),
        ("extract", "Write a docstring for each function in this code and reply with the whole code including "
                    "the docstrings.\n\n```python\n" + _MOVING_AVERAGE + "```"),
    ],
    "free": [
        ("free", "Write a Python function that returns the n-th Fibonacci number using memoization, "
                 "with a short explanation."),
        ("free", "Explain in a few paragraphs how a hash table works and what makes lookups fast."),
        ("free", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
        ("free", "Give five practical tips for writing readable Python code, one paragraph each."),
        ("free", "Describe the water cycle to a ten-year-old."),
    ],
    "code": [
        ("code", "Write a Python function `is_prime(n)` that returns True when n is a prime number."),
        ("code", "Write a Python function that merges two sorted lists into one sorted list."),
        ("code", "Implement binary search in Python as a function `binary_search(items, target)`."),
        ("code", "Write a Python class `Stack` with push, pop, peek and is_empty methods."),
        ("code", "Write a Python function that counts how often each word occurs in a text file."),
        ("code", "Write a Python function `flatten(nested)` that flattens arbitrarily nested lists."),
        ("code", "Write a Python function that checks whether a string of brackets ()[]{} is balanced."),
        ("code", "Write a Python function `rle_encode(text)` for run-length encoding, and its decoder."),
        ("code", "Write a Python dataclass `Point` with a method `distance_to(other)`."),
        ("code", "Write a Python function that returns the transpose of a matrix given as a list of lists."),
    ],
}


def suite(name: str) -> list[tuple[str, str]]:
    if name not in SUITES:
        raise ValueError(f"unknown prompt suite {name!r}; choose one of: {', '.join(SUITES)}")
    return SUITES[name]
