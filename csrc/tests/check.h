// A minimal test harness for the C++ unit tests (no third-party framework to fetch):
// KVFLOW_TEST registers a test; KVFLOW_CHECK records a failure and carries on;
// KVFLOW_CHECK_THROWS expects an exception of the given type.
#pragma once

#include <functional>
#include <iostream>
#include <string>
#include <vector>

namespace kvflow::testing {

struct TestCase {
  std::string name;
  std::function<void()> body;
};

inline std::vector<TestCase>& registry() {
  static std::vector<TestCase> tests;
  return tests;
}

inline int& failures() {
  static int count = 0;
  return count;
}

struct Register {
  Register(const char* name, std::function<void()> body) { registry().push_back({name, std::move(body)}); }
};

inline void fail(const char* file, int line, const std::string& what) {
  ++failures();
  std::cerr << file << ":" << line << ": check failed: " << what << "\n";
}

}  // namespace kvflow::testing

#define KVFLOW_CONCAT_INNER(a, b) a##b
#define KVFLOW_CONCAT(a, b) KVFLOW_CONCAT_INNER(a, b)

#define KVFLOW_TEST(name)                                                                         \
  static void name();                                                                             \
  static ::kvflow::testing::Register KVFLOW_CONCAT(register_, name)(#name, name);                 \
  static void name()

#define KVFLOW_CHECK(cond)                                                 \
  do {                                                                     \
    if (!(cond)) ::kvflow::testing::fail(__FILE__, __LINE__, #cond);       \
  } while (0)

#define KVFLOW_CHECK_THROWS(stmt, exception_type)                                                         \
  do {                                                                                                    \
    bool thrown_ = false;                                                                                 \
    try {                                                                                                 \
      stmt;                                                                                               \
    } catch (const exception_type&) {                                                                     \
      thrown_ = true;                                                                                     \
    }                                                                                                     \
    if (!thrown_) ::kvflow::testing::fail(__FILE__, __LINE__, #stmt " did not throw " #exception_type);  \
  } while (0)
