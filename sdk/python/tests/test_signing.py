import time
import unittest

import _helpers  # noqa: F401
from agentq.signing import Refused, Secret, parse_secrets, sign_headers, verify

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
TS = 1614265330
BODY = b'{"test": 2432232314}'
SIG = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


class SigningTest(unittest.TestCase):
    def test_the_standard_webhooks_known_answer_vector(self):
        s = Secret.parse(SECRET)
        self.assertEqual(s.sign(ID, TS, BODY), SIG)
        verify([s], ID, str(TS), SIG, BODY, now=TS)

    def test_tampered_messages_are_refused(self):
        s = [Secret.parse(SECRET)]
        flipped = bytearray(BODY)
        flipped[3] ^= 1
        cases = [
            (ID, str(TS), SIG, bytes(flipped), TS, "no valid"),
            ("msg_other", str(TS), SIG, BODY, TS, "no valid"),
            (ID, str(TS), SIG, BODY, TS + 301, "5 minutes"),
            (ID, str(TS), SIG, BODY, TS - 301, "5 minutes"),
            (ID, "soon", SIG, BODY, TS, "Unix time"),
            (None, str(TS), SIG, BODY, TS, "webhook-id"),
            (ID, None, SIG, BODY, TS, "webhook-timestamp"),
            (ID, str(TS), None, BODY, TS, "webhook-signature"),
            (ID, str(TS), SIG[:20], BODY, TS, "no valid"),
            (ID, str(TS), "v2,abc", BODY, TS, "no valid"),
        ]
        for msg_id, ts, sig, body, now, why in cases:
            with self.assertRaises(Refused) as cm:
                verify(s, msg_id, ts, sig, body, now=now)
            self.assertIn(why, str(cm.exception))
        with self.assertRaises(Refused):
            verify([Secret.generate()], ID, str(TS), SIG, BODY, now=TS)

    def test_any_listed_signature_and_any_secret_will_do(self):
        old, new = Secret.parse(SECRET), Secret.generate()
        verify([new, old], ID, str(TS), "v1,bm9wZQ== " + SIG, BODY, now=TS)
        verify([new, old], ID, str(TS), new.sign(ID, TS, BODY), BODY, now=TS)
        self.assertEqual(Secret.parse(new.expose()), new)
        self.assertEqual(repr(new), "Secret(***)")
        self.assertNotIn(new.expose(), repr(parse_secrets(new.expose() + " " + SECRET)))

    def test_bad_secrets_are_refused(self):
        for bad in ("whsec_!!!", "whsec_c2hvcnQ="):
            with self.assertRaises(ValueError):
                Secret.parse(bad)

    def test_sign_headers_verify(self):
        s = Secret.parse(SECRET)
        h = sign_headers(s, "msg_1", b"{}")
        self.assertEqual(h["webhook-id"], "msg_1")
        self.assertLessEqual(abs(int(h["webhook-timestamp"]) - time.time()), 2)
        verify([s], h["webhook-id"], h["webhook-timestamp"], h["webhook-signature"], b"{}")


if __name__ == "__main__":
    unittest.main()
