# metile_add_command_test: a ctest that runs one command line and checks what it
# prints, shared by the CLI tests of every module (tests/unit/*/CMakeLists.txt).
#   metile_add_command_test(NAME COMMAND program [words...] [ARGS more words...] EXIT N
#     [STDOUT exact text] [STDOUT_MATCH regex] [STDERR regex] [MULTILINE_STDERR])
# COMMAND and ARGS are one command line; ARGS lets a module's wrapper fix the
# program and subcommand while its call sites name only their arguments.
# The checks themselves live in expect_command.cmake beside this file.
set(METILE_EXPECT_COMMAND_SCRIPT ${CMAKE_CURRENT_LIST_DIR}/expect_command.cmake)

function(metile_add_command_test name)
  cmake_parse_arguments(ARG "MULTILINE_STDERR" "EXIT;STDOUT;STDOUT_MATCH;STDERR" "COMMAND;ARGS" ${ARGN})
  if(NOT DEFINED ARG_EXIT OR NOT ARG_COMMAND)
    message(FATAL_ERROR "metile_add_command_test(${name}): COMMAND and EXIT are required")
  endif()
  list(JOIN ARG_COMMAND "|" joined)
  if(ARG_ARGS)
    list(JOIN ARG_ARGS "|" arguments)
    string(APPEND joined "|${arguments}")
  endif()
  set(defines "-DCOMMAND=${joined}" -DEXPECT_EXIT=${ARG_EXIT})
  foreach(kind STDOUT STDOUT_MATCH STDERR)
    if(DEFINED ARG_${kind})
      list(APPEND defines "-DEXPECT_${kind}=${ARG_${kind}}")
    endif()
  endforeach()
  if(ARG_MULTILINE_STDERR)
    list(APPEND defines -DALLOW_MULTILINE_STDERR=ON)
  endif()
  add_test(NAME ${name} COMMAND ${CMAKE_COMMAND} ${defines} -P ${METILE_EXPECT_COMMAND_SCRIPT})
  set_tests_properties(${name} PROPERTIES LABELS unit)
endfunction()
