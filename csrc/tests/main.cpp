// Runs every registered C++ unit test; exits non-zero if any check failed.
#include <exception>
#include <iostream>

#include "check.h"

int main() {
  using namespace kvflow::testing;
  int passed = 0, failed = 0;
  for (const TestCase& test : registry()) {
    const int before = failures();
    try {
      test.body();
    } catch (const std::exception& e) {
      fail(__FILE__, __LINE__, test.name + " threw: " + e.what());
    }
    if (failures() == before) {
      ++passed;
    } else {
      ++failed;
      std::cerr << "FAILED " << test.name << "\n";
    }
  }
  std::cout << passed << " passed, " << failed << " failed\n";
  return failed == 0 ? 0 : 1;
}
