"""Worker scripts, stubs and helpers that the tests start or import (tests/README.md); no tests here."""
